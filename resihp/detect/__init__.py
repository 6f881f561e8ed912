"""Workload-aware fail-slow / fail-stop detection, baselines and evaluation (issue 3)."""
