"""resihp: the resilience layer for hybrid-parallel LLM training."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy, so that ``import resihp`` stays light (no torch) for the CLI and the analysis tools
    if name == "attach":
        from resihp.train.attach import attach

        return attach
    raise AttributeError(f"module 'resihp' has no attribute {name!r}")
