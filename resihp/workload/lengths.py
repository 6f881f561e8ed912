"""Sequence-length sources: real document lengths, read from files of one integer per line."""

from __future__ import annotations

from array import array
from pathlib import Path

import numpy as np

from resihp.errors import InputError
from resihp.paths import TRACES

LENGTHS_DIR = TRACES / "lengths"


def source_names() -> list[str]:
    return sorted(p.stem for p in LENGTHS_DIR.glob("*.txt"))


MAX_LENGTHS = 1_000_000  # ``resihp profile --max-lengths``'s default: far more than a profile times


def load_lengths(
    path: str | Path, limit: int | None = None, flag: str = "--max-lengths"
) -> np.ndarray:
    """Read one positive integer per line; blank lines and ``#`` comments are skipped.

    Streamed: 8 bytes a length held.

    Args:
        path: the lengths file.
        limit: at most this many lengths; past it, an InputError naming the file, the limit and
            ``flag`` (None: no limit).
        flag: the option that raises the limit, for the error.
    """
    path = Path(path)
    values = array("q")
    number = 0
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                text = line.split("#", 1)[0].strip()
                if not text:
                    continue
                try:
                    value = int(text)
                except ValueError:
                    raise InputError(
                        f"{path}:{number}: expected one integer sequence length per line, got "
                        f"{text[:40]!r}"
                    ) from None
                if value <= 0:
                    raise InputError(
                        f"{path}:{number}: sequence length must be positive, got {value}"
                    )
                if value >= 2**63:
                    raise InputError(
                        f"{path}:{number}: sequence length must fit in 64 bits, got {text[:40]}..."
                    )
                if limit is not None and len(values) >= limit:
                    raise InputError(
                        f"{path}: more than {limit} sequence lengths (line {number}); "
                        f"raise {flag} to read more, or cut the file"
                    )
                values.append(value)
    except OSError as exc:
        raise InputError(f"{path}: cannot read lengths file ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise InputError(
            f"{path}: not a text file (expected one integer sequence length per "
            f"line; undecodable bytes after line {number})"
        ) from None
    if not values:
        raise InputError(f"{path}: no sequence lengths found (expected one integer per line)")
    return np.frombuffer(values, dtype=np.int64).copy()


def resolve_source(source: str, name: str = "length source") -> np.ndarray:
    """The lengths of a source by name (``code``, ``text``) or of a lengths file by path.

    ``name``: what the user gave it as (an option, a file's field), for the error."""
    if source in source_names():
        return load_lengths(LENGTHS_DIR / f"{source}.txt")
    if Path(source).exists():
        return load_lengths(source)
    raise InputError(f"{name} {source!r}: not a file and not one of {', '.join(source_names())}")


def chunk_documents(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Split documents longer than ``max_len`` into full chunks plus a remainder, in order."""
    if max_len < 1:
        raise InputError(f"max sequence length must be positive, got {max_len}")
    lengths = np.asarray(lengths, dtype=np.int64)
    full, rest = np.divmod(lengths, max_len)
    counts = full + (rest > 0)
    out = np.full(int(counts.sum()), max_len, dtype=np.int64)
    ends = np.cumsum(counts) - 1
    has_rest = rest > 0
    out[ends[has_rest]] = rest[has_rest]
    return out


def sample_sequences(
    lengths: np.ndarray, n_tokens: int, max_len: int, rng: np.random.Generator
) -> np.ndarray:
    """Draw whole documents at random until ``n_tokens`` tokens, chunked to ``max_len``.

    Args:
        lengths: the source's document lengths.
        n_tokens: the tokens to draw (the last sequence may pass it).
        max_len: the longest sequence; longer documents are chunked.
        rng: the random generator.
    """
    mean = float(np.minimum(lengths, max_len).mean())
    draws = []
    total = 0
    while total < n_tokens:
        batch = chunk_documents(
            rng.choice(lengths, size=max(16, int(2 * n_tokens / mean))), max_len
        )
        draws.append(batch)
        total += int(batch.sum())
    seqs = np.concatenate(draws)
    return seqs[: int(np.searchsorted(np.cumsum(seqs), n_tokens)) + 1]
