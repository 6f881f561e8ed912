"""YAML loading that remembers the line of every mapping, so validation errors can name the line."""

from __future__ import annotations

from pathlib import Path

import yaml

from resihp.yamlio import read_yaml_mapping


class LineDict(dict):
    """A mapping from YAML that knows the 1-based line it started on."""

    line: int = 0
    key_lines: dict = {}  # noqa: RUF012  (replaced per instance: key -> the 1-based line it is on)


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LineDict:
    loader.flatten_mapping(node)
    out = LineDict(loader.construct_pairs(node, deep=True))
    out.line = node.start_mark.line + 1
    out.key_lines = {
        loader.construct_object(k, deep=True): k.start_mark.line + 1
        for k, _ in node.value
        if isinstance(k, yaml.ScalarNode)
    }
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str | Path) -> LineDict:
    return read_yaml_mapping(
        path,
        "scenario",
        "a scenario must be a mapping (cluster, model, parallel, duration, ...)",
        loader=_Loader,
    )
