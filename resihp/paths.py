"""Where the repository's shipped data lives (models/, traces/)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACES = REPO_ROOT / "traces"
MODELS = REPO_ROOT / "models"
