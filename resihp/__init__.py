"""resihp: the resilience layer for hybrid-parallel LLM training."""

__version__ = "0.1.0"
