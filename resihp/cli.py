"""The ``resihp`` command: each area registers its own verbs; bad input exits 2 with one line."""

from __future__ import annotations

import importlib
import sys

import typer

from resihp.errors import InputError, SetupError, disk_full
from resihp.procexit import run_then_exit

app = typer.Typer(
    name="resihp",
    help="Resilience layer for hybrid-parallel LLM training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from resihp import __version__

        print(f"resihp {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False,
        "--version",
        "-V",
        callback=_version,
        is_eager=True,
        help="Print the version and exit",
    ),
) -> None:
    """Resilience layer for hybrid-parallel LLM training."""


# Each module defines ``register(app)``; the order is the order of ``resihp --help``.
COMMAND_MODULES = [
    "resihp.perf.commands",
    "resihp.detect.commands",
    "resihp.launch.commands",
    "resihp.launch.follow_commands",
    "resihp.plan.commands",
    "resihp.replay.commands",
]

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


# the usage errors of the click that typer runs on (its own copy from typer 0.2x on)
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def main() -> None:
    try:
        # standalone, click would print usage errors in a box of several lines
        code = app(standalone_mode=False, prog_name="resihp")
    except _CLICK_ERROR as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare ``resihp``: its help
            exc.show()
            sys.exit(2)
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "resihp"
        print(f"resihp: error: {where}: {exc.format_message()} (see {where} -h)", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("resihp: aborted", file=sys.stderr)
        sys.exit(1)
    except InputError as exc:
        print(f"resihp: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except SetupError as exc:
        print(f"resihp: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("resihp: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:
        full = disk_full(exc)
        if full is None:
            raise
        # what was written before stays valid: outputs are replaced whole (temp file, rename)
        name = getattr(full, "filename", None)
        where = f" writing {name}" if name else ""
        print(
            f"resihp: disk full{where} "
            f"({getattr(full, 'strerror', None) or 'No space left on device'}); "
            "free space and run again",
            file=sys.stderr,
        )
        sys.exit(1)
    if isinstance(code, int) and code:  # a verb's typer.Exit(code)
        sys.exit(code)


def entry() -> None:
    """The installed ``resihp`` command and ``python -m resihp.cli``.

    ``main``, then the process ends without finalising torch and the other modules it imported
    (``resihp.procexit``). Tests call ``main`` in their own process instead."""
    run_then_exit(main)


if __name__ == "__main__":
    entry()
