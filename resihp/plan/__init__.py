"""Cluster and model specs, Plan, the OR-Tools planner and the baseline policies.

Public API (import from the submodules; this package imports nothing so that the CLI starts fast):

- ``specs``: ``ClusterSpec.from_yaml / from_dict / with_speeds / healthy / topology``,
  ``ModelSpec.from_yaml / from_dict``, ``stage_memory_gb``, ``layer_memory_gb``
- ``plan``: ``Plan`` (``to_json / from_json / load / save / placement / check_against``),
  ``Pipeline``, ``Stage``, ``plan_problems`` (a plan's ``layout`` is a ``resihp.parallel.ParallelDims``)
- ``planner``: ``Planner(cost_model, horizon_steps, threads, token_budgets).plan(cluster, model,
  current, time_limit_s)`` (keep one planner for a job's re-plans: it caches what speeds do not
  change, ``memo``), ``capacity_bound``, ``healthy_plan``
- ``baselines``: ``make_policy(name)`` for ``resihp``, ``uniform``, ``resihp-heuristic``,
  ``drop-replica``, all with the planner's ``plan`` signature
- ``cost``: ``AnalyticCost``, ``PredictorCost``; ``timing``: ``evaluate``, ``StageCoster``
"""
