"""Running the ``resihp`` command in-process for the tests."""

from __future__ import annotations

import sys

from resihp.cli import main


def run_resihp(argv: list[str], capsys) -> tuple[int, str, str]:
    """``resihp ARGV`` through the command's own entry point: (exit code, stdout, stderr)."""
    saved = sys.argv
    sys.argv = ["resihp", *argv]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        sys.argv = saved
    out, err = capsys.readouterr()
    return code, out, err
