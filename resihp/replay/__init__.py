"""Trace replay at cluster scale: the live detector and planner against failure and workload traces,
beside the policies of other published systems."""
