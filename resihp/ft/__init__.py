"""Replica-level fault tolerance: the data-parallel replica is the unit of failure.

Membership is decided per step on the job's store (``quorum``), survivors sum gradients over a
cross-replica group that is re-formed for each membership (``group``), and a replica that comes back
catches up from a live peer while the others keep stepping (``heal``)."""
