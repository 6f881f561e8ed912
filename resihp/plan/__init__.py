"""Cluster and model specs, Plan, the OR-Tools planner and the baseline policies.

Public API (import from the submodules; this package imports nothing so that the CLI starts fast):

- ``specs``: ``ClusterSpec.from_yaml / from_dict / uniform / with_speeds / healthy / topology /
  free_memory_gb`` (also the replay's cluster), ``ModelSpec.from_yaml / from_dict``, the memory
  model: ``stage_memory_gb``, ``pipeline_memory_gb``, ``layer_memory_gb``
- ``plan``: ``Plan`` (``to_json / from_json / load / save / placement / check_against``),
  ``Pipeline``, ``Stage``, ``plan_problems`` (a plan's ``layout`` is a
  ``resihp.parallel.ParallelDims``)
- ``planner``: ``Planner(cost_model, horizon_steps, threads, token_budgets).plan(cluster, model,
  current, time_limit_s)`` (keep one planner for a job's re-plans: it caches what speeds do not
  change, ``memo``), ``capacity_bound``, ``healthy_plan``
- ``baselines``: ``make_policy(name)`` for ``resihp``, ``uniform``, ``resihp-heuristic``,
  ``drop-replica``, all with the planner's ``plan`` signature
- ``cost``: ``AnalyticCost``, ``PredictorCost`` and the analytic formulas the replay's simulator
  shares (``tp_allreduce_s``, ``p2p_s``, ``grad_sync_s``, ``optimizer_s``, ``head_flops``,
  ``flops_per_s``); ``timing``: ``evaluate``, ``StageCoster``
"""
