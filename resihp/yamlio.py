"""Reading a YAML file that must hold a mapping, with the one-line errors the CLI prints.

Aliases (``*name``) are refused: a few hundred bytes of nested aliases expand to gigabytes (the
"billion laughs"), and none of resihp's files needs them. A key given twice in one mapping is
refused too (which of two values a user meant is not for resihp to guess). Files are bounded in
size. ``check_keys`` refuses keys a schema does not know, naming the key (and the known key it
probably meant)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from resihp.errors import InputError

MAX_BYTES = 16 * 2**20  # a spec or scenario is kilobytes; more is not one of resihp's files


class _AliasRefused(yaml.YAMLError):
    def __init__(self, mark: yaml.Mark) -> None:
        super().__init__("YAML aliases (*name) are not allowed")
        self.problem, self.problem_mark = "YAML aliases (*name) are not allowed", mark


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, mark: yaml.Mark) -> None:
        super().__init__(f"key {key!r} given twice")
        self.problem, self.problem_mark = f"key {key!r} given twice in one mapping", mark


class _NoAliases:
    """Mixed into a SafeLoader: an alias event is an error before anything is expanded, and so is
    a key given twice in one mapping (PyYAML keeps the last one without a word)."""

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            raise _AliasRefused(self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def flatten_mapping(self, node):  # noqa: ANN001 - PyYAML's; every mapping constructor calls it
        super().flatten_mapping(node)
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise _DuplicateKey(key_node.value, key_node.start_mark)
                seen.add(key_node.value)


_LOADERS: dict[type, type] = {}


def _no_alias_loader(loader: type[yaml.SafeLoader]) -> type[yaml.SafeLoader]:
    if loader not in _LOADERS:
        _LOADERS[loader] = type(f"NoAlias{loader.__name__}", (_NoAliases, loader), {})
    return _LOADERS[loader]


def read_yaml_mapping(
    path: str | Path, what: str, expected: str, loader: type[yaml.SafeLoader] = yaml.SafeLoader
) -> dict[str, Any]:
    """The mapping in YAML file ``path``; syntax errors and aliases name the line.

    Args:
        path: the YAML file.
        what: names the file in read errors ("cannot read job meta").
        expected: the message when the top level is not a mapping.
        loader: a ``yaml.SafeLoader`` subclass (the replay's keeps line numbers).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise InputError(
                f"{path}: {size} bytes; a {what} file is at most {MAX_BYTES // 2**20} MiB"
            )
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what} ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: cannot read {what} (not UTF-8 text)") from None
    try:
        data = yaml.load(text, Loader=_no_alias_loader(loader))  # noqa: S506 - a SafeLoader (subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InputError(
            f"{path}{line}: not valid YAML ({getattr(exc, 'problem', None) or exc})"
        ) from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: {expected}")
    return data


def check_keys(
    data: Mapping, known: Iterable[str], where: str, *, typos_only: bool = False
) -> None:
    """Refuse a key of ``data`` that is not in ``known`` with a one-line InputError.

    The error names the key, the known keys and the one it probably meant.

    Args:
        data: the mapping read.
        known: its allowed keys.
        where: what the error names as the mapping (file and section).
        typos_only: let through keys that are not close to a known one (a format that admits
            foreign fields, such as a public trace's job meta).
    """
    known = sorted(known)
    for key in data:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.8 if typos_only else 0.6)
        if typos_only and not close:
            continue
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise InputError(f"{where}: unknown key {key!r}{hint}; known keys: {', '.join(known)}")
