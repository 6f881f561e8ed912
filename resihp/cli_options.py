"""A configuration tree's leaves as typer options.

A verb declares its own few options and takes the tree's as ``**options``; the flags, help, choices
and defaults come from the tree's fields."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from resihp.errors import InputError
from resihp.options import SEED_MAX, Flag, build, field_types, leaves, scalar_type

F = TypeVar("F", bound=Callable[..., Any])

# a verb's --seed (resihp run's is RunConfig's train.seed, with the same range)
Seed = Annotated[int, typer.Option(min=0, max=SEED_MAX, help="Random seed (0 to 2**32 - 1)")]


def _list_item(tp: Any) -> type | None:
    """int or float for ``list[int] | None`` / ``list[float] | None``; str for ``list[str]``."""
    for arg in getattr(tp, "__args__", ()) or ():
        if getattr(arg, "__origin__", None) is list:
            return arg.__args__[0]
    if getattr(tp, "__origin__", None) is list:
        return tp.__args__[0]
    return None


def _option(leaf: Flag, default: Any, tp: Any) -> inspect.Parameter:
    decls = (*leaf.meta("decls"), f"--{leaf.flag}")
    kwargs: dict[str, Any] = {"help": leaf.meta("help") or None}
    if leaf.meta("choices"):  # shown here, checked by the tree (a one-line error, exit 2)
        kwargs["metavar"] = "|".join(leaf.meta("choices"))
    if leaf.meta("panel"):
        kwargs["rich_help_panel"] = leaf.meta("panel")
    scalar, item = scalar_type(tp), _list_item(tp)
    if scalar is bool:
        decls = (f"--{leaf.flag}/--no-{leaf.flag}",)
        annotation: Any = bool
    elif item is str:  # repeatable
        annotation, default = list[str], None
    elif item is not None:  # comma-separated numbers
        annotation, default = str, None
    elif scalar is not None:
        annotation = scalar
    else:
        raise TypeError(f"{leaf.dotted}: no command-line form for {tp!r}")
    if leaf.name == "out":
        annotation, default = Path, Path(default)
    return inspect.Parameter(
        leaf.param,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[annotation, typer.Option(*decls, **kwargs)],
    )


def tree_options(tree: type, defaults: Any | None = None) -> Callable[[F], F]:
    """Add the command-line leaves of ``tree`` to a verb whose signature ends in ``**options``.

    Their defaults come from ``defaults``, else ``tree()``."""
    base = defaults if defaults is not None else tree()

    def wrap(func: F) -> F:
        sig = inspect.signature(func, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = []
        for leaf in leaves(tree):
            if not leaf.on_cli:
                continue
            value = base
            for part in leaf.path:
                value = getattr(value, part)
            if leaf.field.default is None:  # None means "decided from the other options"
                value = None
            added.append(_option(leaf, value, field_types(leaf.owner)[leaf.name]))
        taken = {p.name for p in own}
        clash = [p.name for p in added if p.name in taken]
        if clash:
            raise TypeError(f"{func.__name__}: options declared twice: {clash}")
        func.__signature__ = sig.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
        func.__annotations__ = {**func.__annotations__, **{p.name: p.annotation for p in added}}
        return func

    return wrap


def tree_from_options(tree: type, options: dict[str, Any]) -> Any:
    """The tree from a verb's ``**options`` (comma-separated numbers parsed, unset lists
    dropped)."""
    return build(tree, from_command_line(tree, options), "options")


def from_command_line(tree: type, options: dict[str, Any]) -> dict[str, Any]:
    """Flat leaves as the command line gave them -> flat leaves as the tree holds them."""
    flat: dict[str, Any] = {}
    for leaf in leaves(tree):
        if leaf.param not in options:
            continue
        value = options[leaf.param]
        item = _list_item(field_types(leaf.owner)[leaf.name])
        if item is str:
            value = list(value or [])
        elif item is not None and isinstance(value, str):
            value = parse_numbers(value, f"--{leaf.flag}", item)
        elif isinstance(value, Path):
            value = str(value)
        flat[leaf.param] = value
    return flat


def add_arguments(parser: argparse.ArgumentParser, tree: type) -> None:
    """The same leaves as argparse options, for ``python -m`` entry points without typer's CLI.

    Each defaults to None, meaning "not given"."""
    for leaf in leaves(tree):
        if not leaf.on_cli:
            continue
        tp = field_types(leaf.owner)[leaf.name]
        scalar, item, decl = scalar_type(tp), _list_item(tp), f"--{leaf.flag}"
        if scalar is bool:
            parser.add_argument(
                decl, dest=leaf.param, action=argparse.BooleanOptionalAction, default=None
            )
        elif item is str:
            parser.add_argument(decl, dest=leaf.param, action="append", default=None)
        elif item is not None:
            parser.add_argument(decl, dest=leaf.param, default=None, help="comma-separated")
        else:
            parser.add_argument(
                decl, dest=leaf.param, type=scalar, default=None, choices=leaf.meta("choices")
            )


def parse_numbers(text: str, flag: str, kind: type) -> list:
    """The comma-separated numbers of ``text``; else a one-line InputError naming ``flag``.

    Args:
        text: the option's value, such as ``2,2``.
        flag: the option, for the error.
        kind: the numbers' type (``int``, ``float``).
    """
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        raise InputError(
            f"{flag} {text!r}: expected comma-separated {kind.__name__}s, e.g. 2,2"
        ) from None


def renamed(value: Any, old_value: Any, old: str, new: str) -> Any:
    """The value of option ``new`` where a verb still accepts its old name ``old``.

    The old name is hidden, so that one option name means one thing across verbs: it works and
    says once, on stderr, what it is called now; both at once is an error.

    Args:
        value: the value given as ``new`` (None: not given).
        old_value: the value given as ``old`` (None: not given).
        old: the old option name, such as ``--model``.
        new: the new option name, such as ``--predictor``.
    """
    if old_value is None:
        return value
    if value is not None:
        raise InputError(f"{old} is the old name of {new}: give one of them")
    typer.echo(f"resihp: {old} is now {new} (the old name still works)", err=True)
    return old_value
