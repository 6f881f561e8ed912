"""Resilience policies replayed side by side: each a small class over ``resihp.replay.engine.Policy``."""
