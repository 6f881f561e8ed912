"""YAML loading that remembers the line of every mapping, so validation errors can name the line."""

from __future__ import annotations

from pathlib import Path

import yaml

from resihp.errors import InputError


class LineDict(dict):
    """A mapping from YAML that knows the 1-based line it started on."""

    line: int = 0


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LineDict:
    loader.flatten_mapping(node)
    out = LineDict(loader.construct_pairs(node, deep=True))
    out.line = node.start_mark.line + 1
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str | Path) -> LineDict:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"{path}: cannot read scenario ({exc.strerror})") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InputError(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    if not isinstance(data, LineDict):
        raise InputError(f"{path}: a scenario must be a mapping (cluster, model, parallel, duration, ...)")
    return data
