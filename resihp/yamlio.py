"""Reading a YAML file that must hold a mapping, with the one-line errors the CLI prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from resihp.errors import InputError


def read_yaml_mapping(path: str | Path, what: str, expected: str,
                      loader: type[yaml.SafeLoader] = yaml.SafeLoader) -> dict[str, Any]:
    """The mapping in YAML file ``path``. ``what`` names the file in read errors ("cannot read job
    meta"); ``expected`` is the message when the top level is not a mapping; ``loader`` may be a
    ``yaml.SafeLoader`` subclass (the replay's keeps line numbers). Syntax errors name the line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what} ({exc.strerror})") from None
    try:
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader (subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InputError(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: {expected}")
    return data
