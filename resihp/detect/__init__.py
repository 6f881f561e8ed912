"""Workload-aware fail-slow / fail-stop detection, baselines and evaluation (issue 3).

Public API (other areas import from the submodules named here):

- ``online.OnlineDetector(meta, expected=None, config=None, *, meta_dict=None, layout=None)``:
  ``observe(step_df) -> list[Event]`` (ops-trace rows of one step), ``observe_arrays(step, own, raw,
  expected=None, comm=None) -> list[Event]`` (the vectorised fast path, vectors over ranks),
  ``finish() -> list[Event]``.
- ``online.detect_trace(df, meta=None, expected=None, config=None, meta_dict=None) -> dict``: the
  DESIGN event JSON for a whole trace.
- ``observe.observe_ops(df, meta, *, expected=None, shape=None, own_quantile=0.1) -> Observations``
  and ``observe.rank_layout(df, meta) -> RankPlacement``: ops trace to per-step, per-rank matrices.
- ``observe.ExpectedCompute``: ``(seq_lens of each micro-batch, phase) -> seconds``;
  ``expected.predictor_expected(predictor, shape)`` wraps a ``MicroBatchPredictor``.
- ``heartbeat.HeartbeatSender``, ``heartbeat.NodeAggregator``, ``heartbeat.HeartbeatMonitor``
  (``poll(step) -> list[Event]`` of kind ``fail-stop``) over a ``torch.distributed.TCPStore``.
- ``baselines.RawThresholdDetector``, ``RelativeScoreDetector``, ``IterationChangePointDetector``:
  the same ``observe_arrays`` / ``finish`` interface.
- ``events.Event``, ``events.events_json``; ``config.DetectorConfig``.
- ``synth.simulate`` / ``suite.evaluate_suite``: labelled traces and scoring (``resihp
  detect-eval``).
"""
