"""Configuration trees: nested dataclasses whose fields say their flag, help, choices and bounds.

So the CLI, the workers and the checks all read one definition.

A field declared with :func:`opt` carries that in its metadata. A *section* is a dataclass of such
fields with a ``SECTION`` name; a tree is a dataclass of sections (and plain fields). Errors name
the field by its path and flag: ``parallel.dp (--dp): expected an integer >= 1, got 0``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from resihp.errors import InputError

SEED_MAX = 2**32 - 1  # the largest seed everything resihp seeds (NumPy, torch) accepts


def opt(
    default: Any = dataclasses.MISSING,
    *,
    help: str = "",
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    finite: bool = False,
    decls: tuple[str, ...] = (),
    panel: str | None = None,
    factory: Callable[[], Any] | None = None,
    cli: bool = True,
) -> Any:
    """A config field: its default, and what the CLI and the checks need to know about it.

    Args:
        default: the field's default (none: required).
        help: the option's help text.
        flag: the command-line flag (default: the field name with dashes).
        choices: the allowed values of a string field.
        minimum: the least allowed number (None allowed when the default is None).
        maximum: the greatest allowed number.
        above: an exclusive lower bound.
        finite: refuse infinities and NaN.
        decls: extra spellings of the flag (``-o``).
        panel: the ``--help`` panel the option is listed under.
        factory: makes the default (for mutable defaults) instead of ``default``.
        cli: False keeps it out of the command line (set only through a config file).
    """
    meta = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "minimum": minimum,
        "maximum": maximum,
        "above": above,
        "finite": finite,
        "decls": decls,
        "panel": panel,
        "cli": cli,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Flag:
    """One leaf of a tree: where it sits, its flag and its declaration."""

    path: tuple[str, ...]  # ("parallel", "dp")
    field: dataclasses.Field
    owner: type

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def flag(self) -> str:
        return self.field.metadata.get("flag") or self.name.replace("_", "-")

    @property
    def param(self) -> str:
        """The keyword this flag has in flat form (``from_flags``) and as a CLI parameter."""
        return self.flag.replace("-", "_")

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def on_cli(self) -> bool:
        return bool(self.field.metadata.get("cli", False))

    def meta(self, key: str) -> Any:
        return self.field.metadata.get(key)


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def leaves(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[Flag]:
    """Every leaf field of a tree, depth first, in declaration order."""
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        if is_section(hints[f.name]):
            yield from leaves(hints[f.name], (*prefix, f.name))
        else:
            yield Flag((*prefix, f.name), f, cls)


def build(cls: type, flat: dict[str, Any], where: str = "") -> Any:
    """A tree from flat keywords, each leaf by its ``param`` name; the rest keep the defaults.

    A section's default is the one its parent declares, not the section class's own."""
    known = {leaf.param for leaf in leaves(cls)}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise InputError(f"{where or cls.__name__}: unknown option(s) {', '.join(unknown)}")
    return _updated(cls(), flat, ())


def updated(tree: Any, **flat: Any) -> Any:
    """A copy of ``tree`` with the leaves named in flat form changed (and checked again)."""
    known = {leaf.param: leaf for leaf in leaves(type(tree))}
    unknown = sorted(set(flat) - set(known))
    if unknown:
        raise InputError(f"{type(tree).__name__}: unknown option(s) {', '.join(unknown)}")
    return _updated(tree, flat, ())


def _updated(tree: Any, flat: dict[str, Any], prefix: tuple[str, ...]) -> Any:
    hints, changes = field_types(type(tree)), {}
    for f in dataclasses.fields(tree):
        if is_section(hints[f.name]):
            sub = {leaf.param for leaf in leaves(hints[f.name])}
            if sub & set(flat):
                changes[f.name] = _updated(getattr(tree, f.name), flat, (*prefix, f.name))
        else:
            key = Flag((*prefix, f.name), f, type(tree)).param
            if key in flat:
                changes[f.name] = flat[key]
    return dataclasses.replace(tree, **changes)


def flat_values(tree: Any) -> dict[str, Any]:
    """The tree's leaves in flat form (the inverse of :func:`build`)."""
    out: dict[str, Any] = {}
    for leaf in leaves(type(tree)):
        value = tree
        for part in leaf.path:
            value = getattr(value, part)
        out[leaf.param] = value
    return out


def from_nested(cls: type, data: dict[str, Any], where: str) -> Any:
    """A tree from its nested dict form (``dataclasses.asdict``), unknown fields refused by path."""
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints, kwargs = field_types(cls), {}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise InputError(f"{where}: unknown field(s) {', '.join(unknown)}")
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        if is_section(hints[f.name]):
            kwargs[f.name] = from_nested(hints[f.name], data[f.name], f"{where}: {f.name}")
        else:
            kwargs[f.name] = data[f.name]
    return cls(**kwargs)


class Section:
    """Checks every field of a section against its declaration (type, bounds, choices)."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_section(self)


def check_section(section: Any) -> None:
    hints = field_types(type(section))
    prefix = getattr(section, "SECTION", "")
    for f in dataclasses.fields(section):
        leaf = Flag((prefix, f.name) if prefix else (f.name,), f, type(section))
        check_value(leaf, getattr(section, f.name), hints[f.name])


def check_value(leaf: Flag, value: Any, tp: Any) -> None:
    """Refuse a value its field does not allow: a one-line InputError naming the field and flag.

    Args:
        leaf: the field.
        value: the value given.
        tp: the field's evaluated type.
    """
    where = f"{leaf.dotted} (--{leaf.flag})" if leaf.on_cli else leaf.dotted
    if value is None and leaf.field.default is None:
        return
    kind = scalar_type(tp)
    if kind is bool and not isinstance(value, bool):
        raise InputError(f"{where}: expected true or false, got {value!r}")
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise InputError(f"{where}: expected an integer, got {value!r}")
    if kind is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise InputError(f"{where}: expected a number, got {value!r}")
        if leaf.meta("finite") and not math.isfinite(value):
            raise InputError(f"{where}: expected a finite number, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise InputError(f"{where}: expected a string, got {value!r}")
    choices = leaf.meta("choices")
    if choices and value not in choices:
        raise InputError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")
    low, high = leaf.meta("minimum"), leaf.meta("maximum")
    if kind in (int, float):
        if low is not None and not value >= low:
            what = "an integer" if kind is int else "a number"
            raise InputError(f"{where}: expected {what} >= {low:g}, got {value}")
        above = leaf.meta("above")
        if above is not None and not value > above:
            raise InputError(f"{where}: expected a number > {above:g}, got {value}")
        if high is not None and not value <= high:
            raise InputError(f"{where}: at most {high:,.0f}, got {value}")


def scalar_type(tp: Any) -> type | None:
    """int, float, bool or str for a field's type (``int | None`` counts as int), else None."""
    args = getattr(tp, "__args__", None)
    if tp in (int, float, bool, str):
        return tp
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in (int, float, bool, str):
            return rest[0]
    return None


_TYPES: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """The evaluated field types of a dataclass.

    ``from __future__ import annotations`` makes them strings."""
    if cls not in _TYPES:
        _TYPES[cls] = typing.get_type_hints(cls)
    return _TYPES[cls]
