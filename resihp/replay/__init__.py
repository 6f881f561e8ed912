"""Trace replay at cluster scale: the live detector and planner on failure and workload traces.

They are replayed beside the policies of other published systems."""
