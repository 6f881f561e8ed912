"""The vectorised hot path of the replay: a window of steps for one layout and device speeds.

Per step, each pipeline stage's forward and backward time for each of its micro-batches is the cost
model's compute for that micro-batch (drawn from the real workload's packed micro-batches) divided
by the stage's speed (its slowest device) times a noise multiplier measured on real jobs, plus the
tensor-parallel all-reduces; the step is the 1F1B critical path of every replica (the schedule of
``resihp.perf.schedule``), the data-parallel gradient sync and the optimizer, and the slowest
replica sets the pace. The ops records of a window follow the docs/DESIGN.md contract.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pandas as pd

from resihp.opstrace import COMPUTE_OPTYPES, JobMeta
from resihp.parallel import ParallelDims
from resihp.perf.schedule import CompiledSchedule, compile_schedule, op_end_times
from resihp.plan.cost import flops_per_s, grad_sync_s, optimizer_s, p2p_s, tp_allreduce_s
from resihp.replay.costmodel import MicroBatchPool, build_pool
from resihp.replay.interface import Window
from resihp.replay.layout import CompiledLayout, ReplicaLayout
from resihp.replay.noise import noise_pool
from resihp.replay.scenario import Scenario
from resihp.workload.features import PooledLengths
from resihp.workload.lengths import resolve_source

POOL_MICROBATCHES = 4096
# the fewest (step, replica, stage, micro-batch) durations whose critical paths run in a thread
PATHS_THREAD_MIN = 65536
TRANSFER_JITTER = 0.05  # log-sd of a rank's per-token transfer time from step to step


class Simulator:
    """Simulates windows of steps for a layout and device speeds (the vectorised hot path)."""

    def __init__(self, scenario: Scenario, pool: MicroBatchPool, rng: np.random.Generator) -> None:
        self.scenario = scenario
        self.pool = pool
        self.rng = rng
        self.noise = noise_pool(scenario.noise_job)
        # a window's critical paths run here beside its transfer draws (numpy, mostly without the
        # GIL): made on first use
        self._paths: ThreadPoolExecutor | None = None
        self.rate = flops_per_s(float(scenario.cluster.tflops.min()))  # identical devices
        self._pools = {None: pool}

    def pool_for(self, budget: int | None) -> MicroBatchPool:
        """Micro-batches packed to ``budget`` tokens (the model's budget when None)."""
        if budget not in self._pools:
            self._pools[budget] = shared_pool(self.scenario, budget)
        return self._pools[budget]

    def window(
        self,
        compiled: CompiledLayout,
        speeds: np.ndarray,
        n_steps: int,
        first_step: int,
        start_s: float,
        links: np.ndarray | None = None,
    ) -> Window:
        """Simulate ``n_steps`` steps of ``compiled`` at the given device speeds, as a window.

        A slow link stretches the transfers it takes part in, not compute: its pipeline boundaries
        and its gradient ring (a ring all-reduce runs at its slowest link, and the step waits for
        the slowest ring). The detector sees the pipeline transfers (``transfers``); the simulator
        emits no per-rank collective timings.

        Args:
            compiled: the layout in force, compiled.
            speeds: each device's true speed as a fraction of a healthy one (0: dead).
            n_steps: steps to simulate.
            first_step: the number of the window's first step.
            start_s: the window's start time in seconds.
            links: each device's network link as a fraction of its bandwidth (None: all healthy).
        """
        per_group = []
        link_of = np.ones(len(speeds) + 1) if links is None else np.concatenate([links, [1.0]])
        if not compiled.groups:  # no replica left to run
            return self._stalled(compiled.layout, n_steps, first_step, start_s)
        live = [r for r in compiled.layout.replicas if r.microbatches > 0]
        # the gradient all-reduce waits for the largest per-device shard (layers / group width)
        if (
            "ring" not in compiled.derived
        ):  # each live device and its gradient shard (layers / width)
            compiled.derived["ring"] = (
                np.array([d for r in live for g in r.groups for d in g], dtype=np.int64),
                np.array([n / len(g) for r in live for n, g in zip(r.layers, r.groups) for _ in g]),
            )
        ring_devices, ring_shards = compiled.derived["ring"]
        shard = float(ring_shards.max())
        # grad_sync_s is linear in the shard: the slowest ring's time, at its slowest link
        ring = float((ring_shards / link_of[ring_devices]).max())
        model, cluster = self.scenario.model, self.scenario.cluster
        sync = grad_sync_s(model, cluster, ring, len(live))
        optim = optimizer_s(model, cluster, shard)
        comm_rows = []
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
            # tensor-parallel all-reduces run at link speed, whatever the devices' compute speed;
            # two per layer forward and two backward, while backward compute is twice forward
            comm = (
                tp_allreduce_s(
                    model, cluster, pool.tokens[mb][:, :, None, :], g.width[None, :, :, None]
                )
                * (2.0 * g.layers * g.load)[None, :, :, None]
            )
            sched = compile_schedule("1f1b", pp, m)
            # each replica's activations cross its pipeline at its narrowest group's shard size
            p2p = p2p_s(model, cluster, g.width.min(axis=1))  # [R]
            # each tensor-parallel rank sends its shard to its counterpart on the next stage, as
            # fast as the slower of their links; a replica's transfers wait for its slowest one
            dev_link = link_of[g.devices]  # [R, pp, tp]
            boundary = np.minimum(dev_link[:, :-1], dev_link[:, 1:])  # [R, pp - 1, tp]
            p2p = p2p / boundary.min(axis=(1, 2), initial=1.0)
            end = self._critical_paths(sched, fwd + comm, 2.0 * fwd + comm, p2p)  # [W, R, nodes]
            comm_rows.append((g, boundary))
            tokens += pool.tokens[mb].sum(axis=(1, 2))
            per_group.append((g, mb, fwd, comm, sp, sched, end))
        if "ranks" not in compiled.derived:
            compiled.derived["ranks"] = self._rank_table(compiled)
        meta, rank_device, rank_work, rank_place = compiled.derived["ranks"]
        dims = ParallelDims(meta.dp_size, meta.pp_size, meta.tp_size)
        # the transfers' draws (after every group's, as the random stream has them) while the
        # critical paths run
        transfers = self._transfers(comm_rows, n_steps, dims)
        per_group = [(*rest, end.result()) for *rest, end in per_group]
        for *_, sched, end in per_group:
            replica_time.append(end[..., sched.last_on_rank].max(axis=-1).max(axis=-1))
        step_time = np.max(np.stack(replica_time), axis=0) + sync + optim
        steps = np.arange(first_step, first_step + n_steps)
        layout = compiled.layout
        step_start = start_s + np.concatenate(([0.0], np.cumsum(step_time)[:-1]))
        static = compiled.derived.setdefault("records", {})
        columns = _once(lambda: self._columns(per_group, steps, step_start, speeds, dims, static))
        return Window(
            steps,
            start_s,
            step_time,
            tokens,
            layout,
            lambda: self._ops(columns),
            meta,
            rank_device,
            rank_work,
            columns,
            rank_place,
            transfers,
            lambda i, j: self._columns(per_group, steps, step_start, speeds, dims, static, i, j),
        )

    def _critical_paths(
        self, sched: CompiledSchedule, fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray
    ) -> Future:
        """``op_end_times`` to come: in the simulator's thread for a window of many replicas
        (where it takes milliseconds), else now."""
        if fwd.size < PATHS_THREAD_MIN:
            done: Future = Future()
            done.set_result(op_end_times(sched, fwd, bwd, p2p))
            return done
        if self._paths is None:
            self._paths = ThreadPoolExecutor(1, thread_name_prefix="resihp-paths")
        return self._paths.submit(op_end_times, sched, fwd, bwd, p2p)

    def _transfers(self, rows: list, n_steps: int, dims: ParallelDims) -> np.ndarray:
        """(step x logical rank) seconds per token of each rank's transfers to the next stage (the
        detector's ``comm``): the boundary's healthy rate over its speed, with a measured-size
        jitter; NaN on last stages and padded ranks."""
        out = np.full((n_steps, dims.world_size), np.nan)
        model = self.scenario.model
        per_token = p2p_s(model, self.scenario.cluster) / model.microbatch_tokens
        for g, boundary in rows:
            r, pp, tp = g.devices.shape
            for s in range(pp - 1):
                ranks = dims.rank_of(g.replica_ids[:, None], s, np.arange(tp)[None, :])  # [R, tp]
                base = per_token / g.width[:, s][:, None] / boundary[:, s, :]
                jitter = self.rng.lognormal(0.0, TRANSFER_JITTER, size=(n_steps, r, tp))
                vals = base[None] * jitter
                real = g.devices[:, s, :] >= 0
                out[:, ranks[real]] = vals[:, real]
        return out

    def _rank_table(
        self, compiled: CompiledLayout
    ) -> tuple[JobMeta, np.ndarray, np.ndarray, np.ndarray]:
        """(job meta, device, expected work, (dp_rank, stage, tp_rank)) of every logical rank:
        ranks in the one order of ``resihp.parallel.ParallelDims(replicas, pp_max, tp_max)``;
        -1 / NaN where no device works."""
        layout = compiled.layout
        pp_max = max(len(r.groups) for r in layout.replicas)
        tp_max = max(len(gr) for r in layout.replicas for gr in r.groups)
        dims = ParallelDims(len(layout.replicas), pp_max, tp_max)
        meta = JobMeta(
            dp_size=dims.dp, pp_size=dims.pp, tp_size=dims.tp, world_size=dims.world_size
        )
        rank_device = np.full(meta.world_size, -1, dtype=np.int64)
        rank_work = np.full(meta.world_size, np.nan)
        rank_place = np.full((meta.world_size, 3), -1, dtype=np.int64)
        layer = float(self.pool.fwd_flops_per_layer.mean())
        head = float(self.pool.head_flops.mean())
        mean_tokens = float(self.pool.tokens.mean())
        for g in compiled.groups:
            r, pp, tp = g.devices.shape
            place = np.stack(
                np.broadcast_arrays(
                    g.replica_ids[:, None, None],
                    np.arange(pp)[None, :, None],
                    np.arange(tp)[None, None, :],
                ),
                axis=-1,
            )
            rank = dims.rank_of(place[..., 0], place[..., 1], place[..., 2])
            last = np.where(np.arange(pp) == pp - 1, head, 0.0)
            # expected seconds of the rank's share of a mean micro-batch at full speed
            work = g.load * (
                (g.layers * layer + last) / (g.width * self.rate)
                + 2.0
                * g.layers
                * tp_allreduce_s(self.scenario.model, self.scenario.cluster, mean_tokens, g.width)
            )
            real = g.devices >= 0
            rank_device[rank[real]] = g.devices[real]
            rank_work[rank[real]] = np.broadcast_to(work[..., None], real.shape)[real]
            rank_place[rank[real]] = place[real]
        return meta, rank_device, rank_work, rank_place

    def _stalled(
        self, layout: ReplicaLayout, n_steps: int, first_step: int, start_s: float
    ) -> Window:
        return Window(
            np.arange(first_step, first_step + n_steps),
            start_s,
            np.full(n_steps, np.inf),
            np.zeros(n_steps),
            layout,
            lambda: pd.DataFrame(),
            _columns=dict,
        )

    def _ops(self, columns: Callable[[], dict[str, np.ndarray]]) -> pd.DataFrame:
        cols = columns()
        if not cols:
            return pd.DataFrame()
        frame = pd.DataFrame({k: v for k, v in cols.items() if k not in ("optype", "seq_lens")})
        frame.insert(8, "optype", pd.Series(cols["optype"]).astype(str))
        frame["seq_lens"] = cols["seq_lens"].objects()
        return frame  # row order is free in the contract

    def _columns(
        self,
        per_group: list,
        steps: np.ndarray,
        step_start: np.ndarray,
        speeds: np.ndarray,
        dims: ParallelDims,
        static: dict,
        first: int = 0,
        stop: int | None = None,
    ) -> dict[str, np.ndarray]:
        """The ops records of the window's steps ``first`` to ``stop`` (indices; all by default) as
        columns (``resihp.detect.observe.trace_columns`` form), in (step, stage, replica, tp rank,
        phase, micro-batch) order within each shape group (row order is free in the contract):
        the rank order of ``ParallelDims.rank_of``, so the detector's per-(step, rank) groups come
        in order and need no sort (``observe._group_layout``).
        ``static``: the layout's cache of the columns that are the same every step (by number of
        steps), read-only and shared by every window of the layout."""
        parts: list[dict[str, np.ndarray]] = []
        k = self.scenario.settings.ops_microbatches
        padded = np.concatenate([speeds, [1.0]])
        at = slice(first, stop)
        steps, step_start = steps[at], step_start[at]
        n = len(steps)
        for g, mb, fwd, comm, sp, sched, end in per_group:
            mb, fwd, comm, end = mb[at], fwd[at], comm[at], end[at]
            # when each op began in the simulated schedule: its end minus its (stage) duration
            node = np.zeros((2, g.stages, sched.microbatches), dtype=np.int64)
            node[sched.phase, sched.chunk, sched.mb] = np.arange(sched.nodes)
            node = node[:, :, :k]
            fwd, comm, mb = fwd[..., :k], comm[..., :k], mb[..., :k]  # the recorded micro-batches
            took = np.stack([fwd + comm, 2.0 * fwd + comm], axis=3)  # [W, R, pp, 2, k]
            start = (
                np.stack([end[:, :, node[0]], end[:, :, node[1]]], axis=3)
                - took
                + step_start[:, None, None, None, None]
            ).transpose(0, 2, 1, 3, 4)
            pool = self.pool_for(g.budget)
            w, r, pp, m = fwd.shape
            tp = g.devices.shape[-1]
            # stage before replica from here: [W, pp, R, ...]
            fwd, comm, devices = (
                fwd.transpose(0, 2, 1, 3),
                comm.transpose(0, 2, 1, 3),
                g.devices.transpose(1, 0, 2),
            )
            # [pp, R, tp]: each rank's own pace relative to its stage's (slowest) device
            rel = sp.T[:, :, None] / np.where(devices >= 0, padded[devices], 1.0)
            own = fwd[:, :, :, None, :] * rel[None, :, :, :, None]  # [W, pp, R, tp, M]
            shape = (w, pp, r, tp, 2, m)
            dur = np.stack([own, 2.0 * own], axis=4) + comm[:, :, :, None, None, :]
            # no padded ranks: no mask (and none of the copies a mask makes)
            real = (
                slice(None)
                if (devices >= 0).all()
                else np.broadcast_to((devices >= 0)[None, :, :, :, None, None], shape).ravel()
            )

            def grid(
                values: np.ndarray, axes: tuple[int, ...], shape=shape, real=real
            ) -> np.ndarray:
                """``values`` (laid along ``axes`` of the record grid) on every real record."""
                at = [slice(None) if i in axes else None for i in range(len(shape))]
                return np.broadcast_to(values[tuple(at)], shape).ravel()[real]

            mbi = grid(mb, (0, 2, 5))
            parts.append(
                {
                    "step": grid(steps, (0,)),
                    "tokens": pool.tokens[mbi].astype(np.int64, copy=False),
                    "duration": dur.ravel()[real],
                    "start_ts": grid(start, (0, 1, 2, 4, 5)),
                    "seq_lens": PooledLengths(pool.lengths, mbi),
                }
            )
        if not parts:
            return {}
        cols = (
            parts[0]
            if len(parts) == 1
            else {
                c: PooledLengths.concatenate([p[c] for p in parts])
                if c == "seq_lens"
                else np.concatenate([p[c] for p in parts])
                for c in parts[0]
            }
        )
        if n not in static:
            static[n] = self._static_columns(per_group, dims, n, k)
        cols.update(static[n])
        return cols

    @staticmethod
    def _static_columns(per_group: list, dims: ParallelDims, n: int, k: int) -> dict:
        """The columns of ``n`` steps' records that do not change from step to step (rank, place,
        micro-batch index, device, phase), in ``_columns``' row order, read-only."""
        parts = []
        for g, mb, *_ in per_group:
            r, pp, tp = g.devices.shape
            devices = g.devices.transpose(1, 0, 2)  # stage before replica, as ``_columns``
            shape = (pp, r, tp, 2, min(k, mb.shape[-1]))
            real = (devices >= 0)[:, :, :, None, None]

            def grid(
                values: np.ndarray, axes: tuple[int, ...], shape=shape, real=real
            ) -> np.ndarray:
                at = [slice(None) if i in axes else None for i in range(len(shape))]
                one = np.broadcast_to(values[tuple(at)], shape)[np.broadcast_to(real, shape)]
                return np.tile(one, n)  # the steps are the outermost axis of the record grid

            dp_rank, stage, tp_rank = (
                grid(g.replica_ids, (1,)),
                grid(np.arange(pp), (0,)),
                grid(np.arange(tp), (2,)),
            )
            parts.append(
                {
                    "rank": dims.rank_of(dp_rank, stage, tp_rank),
                    "dp_rank": dp_rank,
                    "stage": stage,
                    "tp_rank": tp_rank,
                    "mb_id": grid(np.arange(shape[-1]), (4,)),
                    "device": grid(devices, (0, 1, 2)),
                    "optype": grid(np.array([0, 1], dtype=np.int8), (3,)),
                }
            )
        cols = (
            parts[0]
            if len(parts) == 1
            else {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}
        )
        for v in cols.values():
            v.flags.writeable = False
        # codes 0 and 1 by construction: pandas' check of every row is not needed
        cols["optype"] = pd.Categorical.from_codes(cols["optype"], dtype=_OPTYPE, validate=False)
        return cols


_POOLS: dict[tuple, MicroBatchPool] = {}
_OPTYPE = pd.CategoricalDtype(list(COMPUTE_OPTYPES))


def shared_pool(scenario: Scenario, budget: int | None = None) -> MicroBatchPool:
    """The workload's packed micro-batches, built once per (source, model, budget, seed) and
    shared."""
    m = scenario.model
    budget = budget or m.microbatch_tokens
    key = (
        scenario.workload,
        m.hidden,
        m.heads,
        m.ffn_hidden,
        m.mlp,
        m.vocab,
        m.max_seq_len,
        budget,
        scenario.seed,
    )
    if key not in _POOLS:
        _POOLS[key] = build_pool(
            m,
            resolve_source(scenario.workload),
            POOL_MICROBATCHES,
            np.random.default_rng(scenario.seed),
            budget,
        )
    return _POOLS[key]


def _once(make: Callable[[], dict]) -> Callable[[], dict]:
    """``make`` computed on the first call only (the ops frame and the detectors share it)."""
    cache: list[dict] = []

    def get() -> dict:
        if not cache:
            cache.append(make())
        return cache[0]

    return get
