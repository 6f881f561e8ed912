"""The decision layer between the detector and the planner, shared by live runs and replay.

``Controller`` is pure (no I/O, no clocks, no processes): findings and probe results go in, typed
``Decision``s come out, under one set of thresholds (``ControlConfig``).
"""

from resihp.control.controller import Action, ControlConfig, Controller, Decision

__all__ = ["Action", "ControlConfig", "Controller", "Decision"]
