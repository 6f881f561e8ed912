"""The resihp policy: the workload-aware detector and the OR-Tools planner, as in live runs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from resihp.control import ControlConfig, Controller
from resihp.plan.cost import AnalyticCost
from resihp.plan.plan import Plan
from resihp.plan.planner import Planner
from resihp.plan.specs import ClusterSpec, ModelSpec
from resihp.replay.detectors import DetectorFeed, resihp_detector
from resihp.replay.interface import Context, Detection, Policy, Reaction, Window
from resihp.replay.layout import Replica, ReplicaLayout
from resihp.replay.policies.common import believed_speeds
from resihp.replay.scenario import Scenario


def model_spec(scenario: Scenario) -> ModelSpec:
    """The scenario's model with its workload and its healthy layout's fixed TP and PP degrees."""
    p = scenario.parallel
    return replace(scenario.model, workload=scenario.workload, tp=p.tp, pp=p.pp)


def layout_of(
    plan: Plan, model: ModelSpec, known: dict[tuple, Replica] | None = None
) -> ReplicaLayout:
    """The planner's Plan as the replay's layout (one replica per pipeline, in plan order).

    A pipeline's token share becomes its micro-batch budget (share / micro-batches, rounded up).

    Args:
        plan: the planner's plan.
        model: the model the plan is for.
        known: replicas already built, by (stages, micro-batches, tokens), filled as it goes: a
            re-plan at 16,384 devices keeps most of its hundreds of pipelines.
    """
    known = {} if known is None else known
    replicas = []
    for p in plan.pipelines:
        key = (p.stages, p.microbatches, p.tokens)
        replica = known.get(key)
        if replica is None:
            replica = known[key] = Replica(
                tuple(tuple(map(int, s.ranks)) for s in p.stages),
                tuple(int(s.n_layers) for s in p.stages),
                int(p.microbatches),
                budget=None
                if p.tokens is None or not p.microbatches
                else min(model.microbatch_tokens, -(-int(p.tokens) // int(p.microbatches))),
            )
        replicas.append(replica)
    return ReplicaLayout(
        tuple(replicas),
        note=f"plan: {len(replicas)} pipelines, predicted {plan.step_time_s:.2f} "
        f"s/step, {len(plan.excluded)} excluded",
    )


def suspect_cards(
    cluster: ClusterSpec, links: dict[tuple[int, int], float]
) -> dict[tuple[int, int], float]:
    """Link speeds for the planner when ``links`` (ends: slowdown) were found slow.

    Each end's network card is suspect, so every link from an end to a device on another node runs
    at that speed (links inside a node do not use the card)."""
    node = {r: n for n, ranks in enumerate(cluster.node_ranks) for r in ranks}
    out: dict[tuple[int, int], float] = {}
    for ends, slowdown in links.items():
        speed = 1.0 / max(slowdown, 1.0)
        for end in ends:
            for other in range(len(node)):
                if node[other] != node[end]:
                    key = (min(end, other), max(end, other))
                    out[key] = min(out.get(key, 1.0), speed)
    return out


class Resihp(Policy):
    """resihp: the workload-aware detector of ``resihp.detect`` and the planner of ``resihp.plan``.

    Each window's ops records go to ``OnlineDetector`` (own-work ratio against the analytic cost of
    the micro-batches each rank actually ran, per-rank CUSUM); a ``fail-slow`` event sets that
    device's believed speed to 1/slowdown and the ``Planner`` re-plans tensor-parallel groups, layer
    split and micro-batch allocation from the plan in force; the pause is the plan's estimated
    migration time. A detector recovery event restores the device's speed and re-plans; a device the
    plan excluded cannot be observed in training, so after ``recheck_s`` it runs a short benchmark
    (``Context.benchmark``) and is taken back (and watched again) only when it measures healthy
    (``healthy`` of nominal speed); still slow, it stays out with the measured slowdown and is
    benchmarked again twice as long later, up to ``2 ** max_backoff`` times the interval (the
    policy asks the engine for a look then, ``wake_at``). An extremely slow device is thus never
    let back into training to be found again at its own pace. A ``link-slow`` event sets the link
    between its two devices to 1/slowdown of its bandwidth in the planner's cluster (transfers, not
    compute: the planner moves micro-batches or layers away from it) until the detector sees it
    recover. Which end is slow the finding cannot say, and a device's network card carries all its
    traffic to other nodes (its gradient ring too, which stretches every step): so both ends are
    suspects and the planner sees every inter-node link of each at that speed; it may then move
    layers, swap ranks or let the replica holding an end go (``resihp.plan.links``). A plan that no
    longer uses a slow link cannot see it recover, so its two ends, idle, are probed
    (``Context.benchmark_link``) every ``link_recheck_s``. Fail-stops
    (heartbeat) re-plan without the dead devices and resume from in-memory redundant snapshots
    (``costs.reconfig``, no rollback). Every decision and its threshold is the
    ``resihp.control.Controller``'s (``ControlConfig``), the one the live loop runs. The solver's
    own time runs beside training and is reported, not charged. Simplified: the planner's cost model
    is its analytic one at the scenario's MFU, not a predictor trained on the replayed device.
    """

    name = "resihp"
    observes = True

    def __init__(self, time_limit_s: float = 5.0, control: ControlConfig | None = None) -> None:
        self.time_limit_s = time_limit_s
        self.control = Controller(control or ControlConfig())
        self.feed: DetectorFeed | None = None
        self.solve_s: list[float] = []
        self.replicas: dict[tuple, Replica] = {}  # ``layout_of``'s, kept across re-plans

    def start(self, ctx: Context) -> ReplicaLayout:
        sc = ctx.scenario
        self.cluster = sc.cluster  # the planner's ClusterSpec, every device healthy
        self.model = model_spec(sc)
        # the replay measures its steps: the plans' expected steps are not needed
        self.planner = Planner(AnalyticCost(), expected_steps=False)
        self.plan = self.planner.plan(self.cluster, self.model, None, self.time_limit_s)
        self.feed = resihp_detector(sc)
        return layout_of(self.plan, self.model, self.replicas)

    def replan(self, ctx: Context, label: str, pause_s: float = 0.0) -> Reaction:
        """Plan around the believed device and link speeds; the new plan as a reaction.

        Args:
            ctx: the policy's context.
            label: the reaction's label in the outcome.
            pause_s: seconds the job stands still for the change (besides the migration).
        """
        speeds = np.clip(believed_speeds(ctx, self.control.slow()), 0.0, 1.0)
        cluster = self.cluster.with_speeds(speeds)
        if self.control.links:
            cluster = cluster.with_link_speeds(suspect_cards(cluster, self.control.links))
        plan = self.planner.plan(cluster, self.model, self.plan, self.time_limit_s)
        self.solve_s.append(float(plan.solver.get("solve_s", 0.0)))
        self.plan = plan
        return Reaction(
            layout_of(plan, self.model, self.replicas),
            pause_s,
            migration_s=float(plan.migration_s),
            label=label,
        )

    def on_stop(self, ctx: Context, devices: list[int]) -> Reaction:
        self.control.stopped(devices)
        return self.replan(ctx, "re-plan without dead devices", ctx.scenario.costs.reconfig_s)

    def on_recover(self, ctx: Context, devices: list[int]) -> Reaction | None:
        return self.replan(ctx, "re-plan with repaired devices")

    def wake_at(self, ctx: Context) -> float | None:
        return self.control.wake_at(set(ctx.layout.devices.tolist()), ctx.known_dead)

    def observe(self, ctx: Context, window: Window) -> Reaction | None:
        findings = self.feed.feed(window)
        used = set(ctx.layout.devices.tolist())
        stale = self.control.due_probes(ctx.now, used, ctx.known_dead)
        stale_links = self.control.due_link_probes(ctx.now, used)
        if not findings and not stale and not stale_links:
            return None
        index = findings[0].index if findings else 0
        time_s = window.start_s + float(window.step_time[: index + 1].sum())
        # an excluded device (or a link out of use) cannot be observed in training: probe it
        decisions = [self.control.probed(d, ctx.benchmark(d), ctx.now) for d in stale]
        decisions += [
            self.control.probed_link(e, ctx.benchmark_link(*e), ctx.now) for e in stale_links
        ]
        detections = []
        for f in findings:
            if f.kind == "link-slow":
                ends = (f.device, f.peer)
                if f.ended:
                    decisions.append(self.control.link_recovered(ends))
                    continue
                detections.append(
                    Detection(time_s, f.step, "link-slow", f.device, f.slowdown, f.peer)
                )
                decisions.append(self.control.found_link(ends, f.slowdown, f.step, time_s))
            elif f.ended:
                decisions.append(self.control.found_recovered(f.device))
            else:
                detections.append(Detection(time_s, f.step, "fail-slow", f.device, f.slowdown))
                decisions.append(self.control.found_slow(f.device, f.slowdown, f.step, time_s))
        if not any(d.replan for d in decisions):
            # the detector re-reported what the plan already accounts for
            return Reaction(at=index, detections=detections, label="known")
        what = sorted(self.control.slow()) + [f"{a}-{b}" for a, b in sorted(self.control.links)]
        reaction = self.replan(
            ctx, f"re-plan around slow {what}" if what else "re-plan: slowdown over"
        )
        reaction.at = index
        reaction.detections = detections
        return reaction
