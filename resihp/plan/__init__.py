"""Cluster and model specs, Plan, the OR-Tools planner and the baseline policies."""
