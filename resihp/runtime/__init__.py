"""Hybrid-parallel PyTorch training runtime.

- ``model``: GPT decoder over packed sequences, global layer names; ``tensor_parallel``: Megatron TP.
- ``engine`` (one rank: 1F1B/GPipe over point-to-point ops, gradient sync, optimizer), launched by
  torchrun through ``worker``; ``config.RunConfig`` describes a run; ``data`` the packed batches.
- ``recorder``: ops-trace rows per rank; ``controlplane``: the job's store carries heartbeats
  (``resihp.detect.heartbeat``), step records, plan changes and errors, on one node or many.
- ``inject``: slow / stop / hang faults; ``launch`` / ``supervisor``: run and watch one node's workers.
- ``live``: detector + planner beside the job; ``planchange`` / ``replan`` / ``gradsync``: plan changes
  applied at step boundaries; ``elastic``: exclusion by restart from a universal checkpoint
  (``resihp.ckpt``).
- ``attach``: ``resihp.attach(model, optimizer=..., out=...)`` for a user's own loop.
- ``demo`` / ``report``: the README's demo, its summary and plot.
"""
