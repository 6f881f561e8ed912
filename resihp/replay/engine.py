"""Step-level discrete-event replay of a hybrid-parallel job, vectorised across devices.

Per step, each pipeline stage's forward and backward time for each of its micro-batches is the cost
model's compute for that micro-batch (drawn from the real workload's packed micro-batches) divided by
the stage's speed (its slowest device) times a noise multiplier measured on real jobs; the step is
the 1F1B critical path (``resihp.perf.schedule``) of every replica, the data-parallel gradient sync
and the optimizer, and the slowest replica sets the pace.

Cost per replayed step does not grow with the number of steps: time advances in segments between
events (failures, recoveries, policy actions). Inside a segment the layout and device speeds are
constant, and the only variation is the i.i.d. draw of micro-batches and noise. The engine simulates
``window_steps`` steps in full (and hands them, with their ops records, to the policy), for
``observe_steps`` steps after every change and for one window every ``probe_interval`` (so detectors
also see long healthy stretches, where false alarms happen); between those windows it extrapolates
the rest of the segment at the mean throughput of the last simulated window of the same state. What
is extrapolated is therefore exactly the stretches in which nothing changes; policies see a trace
with gaps between step numbers there, as DESIGN.md allows for sampled traces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from resihp.opstrace import JobMeta
from resihp.perf.schedule import CompiledSchedule, compile_schedule
from resihp.replay.costmodel import (
    MicroBatchPool,
    build_pool,
    comm_seconds,
    device_flops_per_s,
    tp_allreduce_s,
)
from resihp.replay.failures import scenario_events
from resihp.replay.layout import CompiledLayout, Layout, compile_layout, uniform_layout
from resihp.replay.noise import noise_pool
from resihp.replay.scenario import Event, Scenario
from resihp.workload.lengths import resolve_source

POOL_MICROBATCHES = 4096


@dataclass
class Detection:
    """A policy's detector naming a device (or only the job, ``device=None``) as slow or dead."""

    time_s: float
    step: int
    kind: str
    device: int | None
    slowdown: float = float("nan")


@dataclass
class Reaction:
    """What a policy does: a new layout after ``downtime_s`` seconds without progress; ``rollback``
    loses the work since the last checkpoint; ``at`` is the index of the observed step it acted at."""

    layout: Layout | None = None
    downtime_s: float = 0.0
    rollback: bool = False
    at: int | None = None
    label: str = ""
    detections: list[Detection] = field(default_factory=list)
    migration_s: float = 0.0


@dataclass
class Window:
    """Simulated steps handed to a policy: global step numbers, step times, tokens, ops records."""

    steps: np.ndarray
    start_s: float
    step_time: np.ndarray
    tokens: np.ndarray
    layout: Layout
    _ops: Callable[[], pd.DataFrame]
    meta: JobMeta | None = None
    rank_device: np.ndarray | None = None  # logical rank -> device id (-1: no device)
    rank_work: np.ndarray | None = None  # logical rank -> expected forward seconds per micro-batch

    def ops(self) -> pd.DataFrame:
        """The DESIGN.md ops trace of these steps: forward/backward compute of the first
        ``ops_microbatches`` micro-batches of every replica, on every tensor-parallel rank, with
        ``seq_lens`` and ``tokens``; ``rank`` is the logical rank of ``meta``, ``device`` the device.

        Durations are each rank's own compute kernel time (the wait for a slower tensor-parallel peer
        inside the collectives is not in it), so a slow device shows on its own rank only."""
        return self._ops()


class Policy:
    """The interface every replayed policy implements (see ``resihp.replay.policies``)."""

    name = "policy"
    observes = False

    def start(self, ctx: Context) -> Layout:
        return ctx.uniform_layout(set())

    def on_stop(self, ctx: Context, devices: list[int]) -> Reaction:
        raise NotImplementedError

    def on_recover(self, ctx: Context, devices: list[int]) -> Reaction | None:
        return None

    def observe(self, ctx: Context, window: Window) -> Reaction | None:
        return None


class Context:
    """What a policy may know and use: the scenario, the devices known dead, the time, and the
    cost model for its own predictions (with nominal speeds it believes, never the true ones)."""

    def __init__(self, scenario: Scenario, pool: MicroBatchPool) -> None:
        self.scenario = scenario
        self.pool = pool
        self.known_dead: set[int] = set()
        self.now = 0.0
        self.step = 0
        self.last_checkpoint_s = 0.0
        self.layout: Layout | None = None
        m, p = scenario.model, scenario.parallel
        self.total_microbatches = m.global_batch_tokens // m.microbatch_tokens
        self.job_devices = np.arange(p.dp * p.pp * p.tp)
        self.rate = device_flops_per_s(scenario.cluster.device)
        self.mean_fwd_flops = float(pool.fwd_flops_per_layer.mean())
        self.mean_head_flops = float(pool.head_flops.mean())
        self.mean_tokens = float(pool.tokens.mean())

    def uniform_layout(self, exclude: set[int], dp: int | None = None) -> Layout:
        """Megatron-style placement over the whole nodes that hold no excluded device."""
        c, p = self.scenario.cluster, self.scenario.parallel
        g = c.gpus_per_node
        nodes = [n for n in range(len(self.job_devices) // g)
                 if not any(d in exclude for d in range(n * g, (n + 1) * g))]
        devices = np.array([d for n in nodes for d in range(n * g, (n + 1) * g)], dtype=np.int64)
        return uniform_layout(devices, g, dp or p.dp, p.pp, p.tp, self.scenario.model.layers,
                              self.total_microbatches)

    def stage_seconds(self, layers: np.ndarray, width: np.ndarray, speed: np.ndarray,
                      last: np.ndarray | bool = False) -> np.ndarray:
        """Expected forward+backward seconds of one mean micro-batch on a stage (no noise)."""
        flops = np.asarray(layers) * self.mean_fwd_flops + np.where(last, self.mean_head_flops, 0.0)
        comm = 6.0 * np.asarray(layers) * tp_allreduce_s(self.scenario, self.mean_tokens,
                                                         np.asarray(width, dtype=np.float64))
        return 3.0 * flops / (np.asarray(width) * self.rate * np.asarray(speed)) + comm

    def predicted_step_time(self, layout: Layout, speeds: np.ndarray) -> float:
        """1F1B estimate with mean micro-batches: sum of stage times + (m - 1) x slowest stage."""
        worst = 0.0
        padded = np.concatenate([speeds, [np.inf]])
        for r in layout.replicas:
            if r.microbatches == 0:
                continue
            sp = np.array([padded[list(g)].min() for g in r.groups])
            if (sp <= 0).any():
                return float("inf")
            last = np.arange(len(r.groups)) == len(r.groups) - 1
            per = self.stage_seconds(np.array(r.layers), np.array([len(g) for g in r.groups]), sp,
                                     last) * np.array(r.load)
            worst = max(worst, per.sum() + (r.microbatches - 1) * per.max())
        return worst


@dataclass
class Outcome:
    """Everything a replay of one policy measured."""

    policy: str
    duration_s: float
    tokens: float
    capacity_tokens: float
    downtime_s: float
    lost_s: float
    timeline: list[tuple[float, float, float]]  # (start, end, tokens/s)
    capacity_timeline: list[tuple[float, float, float]]
    actions: list[tuple[float, str]]
    detections: list[dict]
    simulated_steps: int
    replayed_steps: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s

    @property
    def bound_fraction(self) -> float:
        return self.tokens / self.capacity_tokens if self.capacity_tokens > 0 else float("nan")

    @property
    def effective_time(self) -> float:
        return max(0.0, 1.0 - (self.downtime_s + self.lost_s) / self.duration_s)

    @property
    def false_alarms(self) -> int:
        return sum(1 for d in self.detections if not d["true"])


class Simulator:
    """Simulates windows of steps for a layout and device speeds (the vectorised hot path)."""

    def __init__(self, scenario: Scenario, pool: MicroBatchPool, rng: np.random.Generator) -> None:
        self.scenario = scenario
        self.pool = pool
        self.rng = rng
        self.noise = noise_pool(scenario.noise_job)
        self.rate = device_flops_per_s(scenario.cluster.device)
        self._pools = {None: pool}

    def pool_for(self, budget: int | None) -> MicroBatchPool:
        """Micro-batches packed to ``budget`` tokens (the model's budget when None)."""
        if budget not in self._pools:
            self._pools[budget] = shared_pool(self.scenario, budget)
        return self._pools[budget]

    def window(self, compiled: CompiledLayout, speeds: np.ndarray, n_steps: int, first_step: int,
               start_s: float) -> Window:
        per_group = []
        if not compiled.groups:  # no replica left to run
            return self._stalled(compiled.layout, n_steps, first_step, start_s)
        live = [r for r in compiled.layout.replicas if r.microbatches > 0]
        # the gradient all-reduce waits for the largest per-device shard (layers / group width)
        shard = max(n / len(g) for r in live for n, g in zip(r.layers, r.groups))
        width = min(len(g) for r in live for g in r.groups)
        p2p, sync, optim = comm_seconds(self.scenario, shard * width, width, len(live))
        replica_time = []
        tokens = np.zeros(n_steps)
        for g in compiled.groups:
            sp = compiled.stage_speeds(g, speeds)  # [R, pp]
            if (sp <= 0).any():  # a dead device in the layout: the job hangs
                return self._stalled(compiled.layout, n_steps, first_step, start_s)
            r, pp, m = len(g.replica_ids), g.stages, g.microbatches
            pool = self.pool_for(g.budget)
            mb = self.rng.integers(len(pool), size=(n_steps, r, m))
            noise = self.rng.choice(self.noise, size=(n_steps, r, pp))
            flops = pool.fwd_flops_per_layer[mb][:, :, None, :] * g.layers[None, :, :, None]
            last = (np.arange(pp) == pp - 1)[None, None, :, None]
            flops = flops + np.where(last, pool.head_flops[mb][:, :, None, :], 0.0)
            scale = g.load / (g.width * self.rate * sp)  # [R, pp]
            fwd = flops * (scale[None, :, :, None] * noise[..., None])
            # tensor-parallel all-reduces run at link speed, whatever the devices' compute speed
            comm = (tp_allreduce_s(self.scenario, pool.tokens[mb][:, :, None, :],
                                   g.width[None, :, :, None])
                    * (2.0 * g.layers * g.load)[None, :, :, None])
            fwd = fwd + comm
            sched = compile_schedule("1f1b", pp, m)
            end = op_end_times(sched, fwd, 2.0 * fwd, p2p)  # [W, R, nodes]
            replica_time.append(end[..., sched.last_on_rank].max(axis=-1).max(axis=-1))
            tokens += pool.tokens[mb].sum(axis=(1, 2))
            per_group.append((g, mb, fwd - comm, comm, sp, sched, end))
        step_time = np.max(np.stack(replica_time), axis=0) + sync + optim
        steps = np.arange(first_step, first_step + n_steps)
        layout = compiled.layout
        pp_max = max(len(r.groups) for r in layout.replicas)
        tp_max = max(len(gr) for r in layout.replicas for gr in r.groups)
        meta = JobMeta(dp_size=len(layout.replicas), pp_size=pp_max, tp_size=tp_max,
                       world_size=len(layout.replicas) * pp_max * tp_max)
        rank_device = np.full(meta.world_size, -1, dtype=np.int64)
        rank_work = np.full(meta.world_size, np.nan)
        layer = float(self.pool.fwd_flops_per_layer.mean())
        head = float(self.pool.head_flops.mean())
        mean_tokens = float(self.pool.tokens.mean())
        for i, r in enumerate(layout.replicas):
            for st, gr in enumerate(r.groups):
                base = (i * pp_max + st) * tp_max
                rank_device[base: base + len(gr)] = gr
                last = head if st == len(r.groups) - 1 else 0.0
                # expected seconds of the rank's share of a mean micro-batch at full speed
                rank_work[base: base + len(gr)] = r.load[st] * (
                    (r.layers[st] * layer + last) / (len(gr) * self.rate)
                    + 2.0 * r.layers[st] * float(tp_allreduce_s(self.scenario, mean_tokens, len(gr))))
        step_start = start_s + np.concatenate(([0.0], np.cumsum(step_time)[:-1]))
        return Window(steps, start_s, step_time, tokens, layout,
                      lambda: self._ops(per_group, steps, step_start, speeds, pp_max, tp_max), meta,
                      rank_device, rank_work)

    def _stalled(self, layout: Layout, n_steps: int, first_step: int, start_s: float) -> Window:
        return Window(np.arange(first_step, first_step + n_steps), start_s,
                      np.full(n_steps, np.inf), np.zeros(n_steps), layout, lambda: pd.DataFrame())

    def _ops(self, per_group: list, steps: np.ndarray, step_start: np.ndarray, speeds: np.ndarray,
             pp_max: int, tp_max: int) -> pd.DataFrame:
        frames = []
        k = self.scenario.settings.ops_microbatches
        padded = np.concatenate([speeds, [1.0]])
        for g, mb, fwd, comm, sp, sched, end in per_group:
            # when each op began in the simulated schedule: its end minus its (stage) duration
            node = np.zeros((2, g.stages, sched.microbatches), dtype=np.int64)
            node[sched.phase, sched.chunk, sched.mb] = np.arange(sched.nodes)
            node = node[:, :, :k]
            stage_fwd = (fwd + comm)[..., :k]
            start_f = end[:, :, node[0]] - stage_fwd + step_start[:, None, None, None]
            start_b = end[:, :, node[1]] - 2.0 * stage_fwd + step_start[:, None, None, None]
            fwd, comm, mb = fwd[..., :k], comm[..., :k], mb[..., :k]
            pool = self.pool_for(g.budget)
            w, r, pp, m = fwd.shape
            tp = g.devices.shape[-1]
            # [R, pp, tp]: each rank's own pace relative to its stage's (slowest) device
            rel = sp[:, :, None] / np.where(g.devices >= 0, padded[g.devices], 1.0)
            own = (fwd[:, :, :, None, :] * rel[None, :, :, :, None]
                   + comm[:, :, :, None, :])  # [W, R, pp, tp, M]
            wi, ri, si, ti, mi = np.meshgrid(np.arange(w), np.arange(r), np.arange(pp), np.arange(tp),
                                             np.arange(m), indexing="ij")
            real = (g.devices[ri, si, ti] >= 0).ravel()
            dp_rank = g.replica_ids[ri].ravel()[real]
            mbi = mb[wi, ri, mi].ravel()[real]
            base = {"step": steps[wi.ravel()[real]],
                    "rank": ((dp_rank * pp_max + si.ravel()[real]) * tp_max + ti.ravel()[real]),
                    "dp_rank": dp_rank, "stage": si.ravel()[real], "tp_rank": ti.ravel()[real],
                    "mb_id": mi.ravel()[real], "tokens": pool.tokens[mbi].astype(np.int64),
                    "device": g.devices[ri, si, ti].ravel()[real]}
            seq = pool.seq_objects[mbi]
            dur = own.ravel()[real]
            tp_axis = (slice(None), slice(None), slice(None), None, slice(None))
            sf = np.broadcast_to(start_f[tp_axis], own.shape).ravel()[real]
            sb = np.broadcast_to(start_b[tp_axis], own.shape).ravel()[real]
            frames.append(pd.DataFrame({**base, "optype": "forward-compute", "duration": dur,
                                        "start_ts": sf, "seq_lens": seq}))
            frames.append(pd.DataFrame({**base, "optype": "backward-compute", "duration": 2.0 * dur,
                                        "start_ts": sb, "seq_lens": seq}))
        if not frames:
            return pd.DataFrame()
        return pd.concat(frames, ignore_index=True)  # row order is free in the contract


class Replay:
    """Replays one scenario under one policy; ``run()`` returns the Outcome."""

    def __init__(self, scenario: Scenario, policy: Policy, seed: int | None = None,
                 events: list[Event] | None = None, pool: MicroBatchPool | None = None) -> None:
        self.scenario = scenario
        self.policy = policy
        seed = scenario.seed if seed is None else seed
        self.rng = np.random.default_rng(seed + 1)
        self.pool = pool or shared_pool(scenario)
        self.events = scenario_events(scenario, seed) if events is None else events
        self.ctx = Context(scenario, self.pool)
        self.sim = Simulator(scenario, self.pool, self.rng)

    def healthy_tokens_per_s(self) -> float:
        layout = self.ctx.uniform_layout(set())
        w = self.sim.window(compile_layout(layout), np.ones(self.scenario.cluster.size),
                            4 * self.scenario.settings.window_steps, 0, 0.0)
        return float(w.tokens.sum() / w.step_time.sum())

    def run(self, on_progress: Callable[[float], None] | None = None) -> Outcome:
        sc, ctx, st = self.scenario, self.ctx, self.scenario.settings
        n = sc.cluster.size
        speeds = np.ones(n)
        base_tps = self.healthy_tokens_per_s()
        job_n = len(ctx.job_devices)
        t, tokens, downtime, lost = 0.0, 0.0, 0.0, 0.0
        timeline: list[tuple[float, float, float]] = []
        capacity: list[tuple[float, float, float]] = []
        actions: list[tuple[float, str]] = []
        detections: list[dict] = []
        history: list[tuple[float, float]] = [(0.0, 0.0)]  # (time, tokens) for checkpoint rollback
        slow_since: dict[int, float] = {}
        detected: set[tuple] = set()
        simulated = 0
        replayed = 0.0
        layout = self.policy.start(ctx)
        ctx.layout = layout
        compiled = compile_layout(layout)
        actions.append((0.0, f"start: {layout.note}"))
        restart_s = 0.0  # the job's last (re)start: a checkpoint exists from then on
        observe_left = st.observe_steps
        next_probe = st.probe_interval_s
        cached: tuple[float, float] | None = None  # (tokens/s, mean step s) of the current state
        ei = 0
        events = self.events

        def tokens_at(time: float) -> float:
            times = np.array([h[0] for h in history])
            toks = np.array([h[1] for h in history])
            return float(np.interp(time, times, toks))

        def advance(t0: float, t1: float, tps: float) -> None:
            nonlocal tokens
            if t1 <= t0:
                return
            tokens += (t1 - t0) * tps
            if timeline and timeline[-1][2] == tps and timeline[-1][1] == t0:
                timeline[-1] = (timeline[-1][0], t1, tps)
            else:
                timeline.append((t0, t1, tps))
            history.append((t1, tokens))
            cap = base_tps * min(1.0, float(speeds[ctx.job_devices].sum()) / job_n)
            capacity.append((t0, t1, cap))

        def apply(reaction: Reaction | None, label: str) -> None:
            nonlocal t, tokens, downtime, lost, layout, compiled, restart_s, observe_left, cached
            if reaction is None:
                return
            for d in reaction.detections:
                truth = d.device is None and any(s < d.time_s for s in slow_since.values())
                truth = truth or (d.device in slow_since) or (d.device in ctx.known_dead)
                # the delay counts once per slow episode: from its onset to its first detection
                episode = (d.device, slow_since.get(d.device))
                delay = None
                if d.device in slow_since and episode not in detected:
                    delay = d.time_s - slow_since[d.device]
                    detected.add(episode)
                detections.append({"time_s": d.time_s, "step": d.step, "kind": d.kind,
                                   "device": d.device, "slowdown": d.slowdown, "true": bool(truth),
                                   "delay_s": delay})
            if reaction.rollback:
                ckpt = max(restart_s, np.floor(t / sc.costs.checkpoint_interval_s)
                           * sc.costs.checkpoint_interval_s)
                lost_tokens = tokens - tokens_at(ckpt)
                lost_time = t - ckpt
                tokens -= lost_tokens
                lost += lost_time
                history.append((t, tokens))
            pause = min(reaction.downtime_s + reaction.migration_s, sc.duration_s - t)
            if pause > 0:
                advance(t, t + pause, 0.0)
                downtime += pause
                t += pause
            if reaction.rollback:
                restart_s = t
                ctx.last_checkpoint_s = t
            if reaction.layout is None and pause <= 0 and not reaction.rollback:
                return  # seen and ignored: nothing changes
            if reaction.layout is not None:
                layout = reaction.layout
                ctx.layout = layout
                compiled = compile_layout(layout)
            actions.append((t, f"{label}: {reaction.label or (layout.note if reaction.layout else '')}"))
            observe_left = st.observe_steps
            cached = None

        while t < sc.duration_s:
            while ei < len(events) and events[ei].at_s <= t:
                batch_t = events[ei].at_s
                stopped, returned = [], []
                while ei < len(events) and events[ei].at_s == batch_t:
                    e = events[ei]
                    ei += 1
                    if e.kind == "slow":
                        speeds[e.device] = 1.0 / e.factor
                        slow_since[e.device] = e.at_s
                    elif e.kind == "stop":
                        speeds[e.device] = 0.0
                        slow_since.pop(e.device, None)
                        stopped.append(e.device)
                    else:
                        if speeds[e.device] == 0.0:
                            returned.append(e.device)
                        speeds[e.device] = 1.0
                        slow_since.pop(e.device, None)
                ctx.now = t
                cached = None
                observe_left = st.observe_steps
                if returned:
                    ctx.known_dead.difference_update(returned)
                    apply(self.policy.on_recover(ctx, returned), f"recover {_names(returned)}")
                if stopped:
                    ctx.known_dead.update(stopped)
                    reaction = self.policy.on_stop(ctx, stopped)
                    reaction.downtime_s += sc.costs.heartbeat_timeout_s
                    apply(reaction, f"stop {_names(stopped)}")
            if t >= sc.duration_s:
                break
            seg_end = min(events[ei].at_s if ei < len(events) else sc.duration_s, sc.duration_s)
            probe_due = t >= next_probe
            if observe_left > 0 or probe_due or cached is None:
                ctx.now, ctx.step = t, int(simulated + replayed)
                win = self.sim.window(compiled, speeds, st.window_steps, ctx.step, t)
                simulated += len(win.steps)
                ends = t + np.cumsum(win.step_time)
                reaction = self.policy.observe(ctx, win) if self.policy.observes else None
                cut = len(win.steps)
                if reaction is not None and reaction.at is not None:
                    cut = min(cut, reaction.at + 1)
                cut = min(cut, int(np.searchsorted(ends, seg_end)) + 1)
                end = min(float(ends[cut - 1]), seg_end) if np.isfinite(ends[cut - 1]) else seg_end
                tps = float(win.tokens[:cut].sum() / win.step_time[:cut].sum()) if np.isfinite(
                    win.step_time[:cut].sum()) else 0.0
                advance(t, end, tps)
                replayed += cut
                t = end
                observe_left -= cut
                if probe_due:
                    next_probe = t + st.probe_interval_s
                if reaction is not None:
                    ctx.now = t
                    apply(reaction, "detect")
                else:
                    cached = (float(win.tokens.sum() / win.step_time.sum()) if np.isfinite(
                        win.step_time.sum()) else 0.0, float(win.step_time.mean()))
            else:
                end = min(seg_end, next_probe)
                tps, mean_step = cached
                advance(t, end, tps)
                if np.isfinite(mean_step) and mean_step > 0:
                    replayed += (end - t) / mean_step
                t = end
            if on_progress:
                on_progress(t)
        cap_tokens = sum((b - a) * c for a, b, c in capacity)
        return Outcome(self.policy.name, sc.duration_s, tokens, cap_tokens, downtime, lost, timeline,
                       capacity, actions, detections, simulated, replayed)


def op_end_times(sched: CompiledSchedule, fwd: np.ndarray, bwd: np.ndarray,
                 p2p_s: float) -> np.ndarray:
    """End time of every op of a compiled schedule, [..., nodes], for [..., stages, micro-batches]
    durations. The same recurrence as ``resihp.perf.schedule.rank_finish_times``, which keeps only
    each rank's last op; the replay also needs when each op ran (the ops records' ``start_ts``)."""
    dur = np.stack(np.broadcast_arrays(fwd, bwd), axis=-3)[..., sched.phase, sched.chunk, sched.mb]
    end = np.zeros(dur.shape[:-1] + (sched.nodes + 1,))
    comm = np.where(sched.dep_is_p2p, p2p_s, 0.0)
    for nodes in sched.levels:
        end[..., nodes] = np.maximum(end[..., sched.prev_same[nodes]],
                                     end[..., sched.prev_dep[nodes]] + comm[nodes]) + dur[..., nodes]
    return end[..., :-1]


def _names(devices: list[int]) -> str:
    return ",".join(map(str, devices)) if len(devices) <= 4 else f"{len(devices)} devices"


_POOLS: dict[tuple, MicroBatchPool] = {}


def shared_pool(scenario: Scenario, budget: int | None = None) -> MicroBatchPool:
    """The workload's packed micro-batches, built once per (source, model, budget, seed) and shared."""
    m = scenario.model
    budget = budget or m.microbatch_tokens
    key = (scenario.workload, m.hidden, m.heads, m.ffn_hidden, m.vocab, m.max_seq_len, budget,
           scenario.seed)
    if key not in _POOLS:
        _POOLS[key] = build_pool(m, resolve_source(scenario.workload), POOL_MICROBATCHES,
                                 np.random.default_rng(scenario.seed), budget)
    return _POOLS[key]
