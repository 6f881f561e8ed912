"""The node side of a run: launching and supervising a node's ranks, and the live loop.

Launching a node's ranks under torchrun, supervising them, warm agents, replica launching, the live
loop beside the job and the ``resihp run`` command.

- ``launch`` / ``supervisor``: run and watch one node's workers; ``warm`` / ``agent``: warm agents.
- ``replicas`` / ``replica_launch``: replica-level fault tolerance, a torchrun job per replica.
- ``live``: detector + planner beside the job; ``commands``: ``resihp run`` and its recovery.
- ``demo`` / ``report``: the README's demo, its summary and plot.
"""
