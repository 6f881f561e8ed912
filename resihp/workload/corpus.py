"""Builds sequence-length sources from real text and code installed on this machine.

Each document's length is its number of GPT-2 pre-tokenisation pieces (the regex GPT-2's BPE
splits on before merging; BPE tokens are at least as many). Regenerate with
``python -m resihp.workload.corpus traces/lengths``; the provenance is written beside each file.
"""

from __future__ import annotations

import gzip
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

# GPT-2's pre-tokeniser with ASCII classes in place of \p{L} and \p{N} (the stdlib has no \p).
_PRETOKEN = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""")
_ROFF_REQUEST = re.compile(r"^[.']\s*\w*.*$", re.MULTILINE)
_ROFF_ESCAPE = re.compile(r"\\f[BIRP]|\\\(..|\\[-&e]")


def count_pretokens(text: str) -> int:
    return sum(1 for _ in _PRETOKEN.finditer(text))


def stdlib_sources() -> Iterator[tuple[str, str]]:
    """CPython's standard library modules (PSF licence), test suites excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in {"site-packages", "test", "idlelib"} or "tests" in rel.parts:
            continue
        yield str(rel), path.read_text(encoding="utf-8", errors="replace")


def man_pages(
    roots: Iterable[Path] = (Path("/usr/share/man/man1"), Path("/usr/share/man/man8")),
) -> Iterator[tuple[str, str]]:
    """Debian's installed manual pages, roff requests and font escapes removed (prose only)."""
    for root in roots:
        for path in sorted(root.glob("*.gz")):
            try:
                raw = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
            except (OSError, EOFError):
                continue
            if raw.lstrip().startswith(".so "):  # a link to another page
                continue
            text = _ROFF_ESCAPE.sub("", _ROFF_REQUEST.sub("", raw))
            yield path.name, text


_CHANGELOG_ENTRY = re.compile(r"^\S.*\(.*\).*;.*urgency=", re.MULTILINE)


def changelog_entries(root: Path = Path("/usr/share/doc")) -> Iterator[tuple[str, str]]:
    """Debian package changelog entries, one document each: many short and medium texts.

    An entry is a version's heading, its change items and the maintainer's sign-off: the shape of
    chat turns."""
    for path in sorted(root.glob("*/changelog.Debian.gz")):
        try:
            text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
        except (OSError, EOFError):
            continue
        starts = [m.start() for m in _CHANGELOG_ENTRY.finditer(text)]
        for k, (a, b) in enumerate(zip(starts, [*starts[1:], len(text)])):
            yield f"{path.parent.name}#{k}", text[a:b]


SOURCES = {
    "code": (
        stdlib_sources,
        "CPython 3.11 standard library modules (.py, tests excluded); "
        "Python Software Foundation License",
    ),
    "text": (
        man_pages,
        "Debian manual pages in /usr/share/man/man1 and man8, roff markup removed; "
        "each page under its package's licence (see /usr/share/doc/<package>/copyright)",
    ),
    "changelog": (
        changelog_entries,
        "Debian package changelog entries "
        "(/usr/share/doc/*/changelog.Debian.gz, one entry per document): many short and "
        "medium documents, a chat-like shape; each under its package's licence (see "
        "/usr/share/doc/<package>/copyright)",
    ),
}


def build(out_dir: Path, names: Iterable[str] | None = None) -> None:
    """Write ``<name>.txt`` for the named sources (all by default) into ``out_dir``.

    Its README lists every source present in ``out_dir``, with provenance and counts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names or SOURCES:
        documents, _ = SOURCES[name]
        lengths = [n for _, text in documents() if (n := count_pretokens(text)) > 0]
        (out_dir / f"{name}.txt").write_text("".join(f"{n}\n" for n in lengths))
    notes = [
        "# Sequence-length sources",
        "",
        "One integer per line: the length in GPT-2 pre-tokenisation pieces of one real document.",
        "Built by `python -m resihp.workload.corpus traces/lengths [NAME ...]` on the development "
        "machine (code and text on an AMD EPYC machine of the first round, changelog on the "
        "second round's machine; only the lengths are kept, no text).",
        "",
    ]
    for name, (_, provenance) in SOURCES.items():
        path = out_dir / f"{name}.txt"
        if path.exists():
            lengths = sorted(int(n) for n in path.read_text().split())
            notes.append(
                f"- `{name}.txt`: {provenance}. {len(lengths)} documents, median "
                f"{lengths[len(lengths) // 2]}, max {lengths[-1]}."
            )
    (out_dir / "README.md").write_text("\n".join(notes) + "\n")


if __name__ == "__main__":
    build(Path(sys.argv[1] if len(sys.argv) > 1 else "traces/lengths"), sys.argv[2:] or None)
