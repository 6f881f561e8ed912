"""The decision layer between the detector and the planner, shared by live runs and replay.

``Controller`` is pure (no I/O, no clocks, no processes): findings and probe results go in, typed
``ControlDecision``s come out, under one set of thresholds (``ControlConfig``).
"""

from resihp.control.controller import ControlAction, ControlConfig, ControlDecision, Controller

__all__ = ["ControlAction", "ControlConfig", "Controller", "ControlDecision"]
