"""The split of a model's layers into pipeline stages (the split of ranks: ``resihp.parallel``)."""

from __future__ import annotations

from collections.abc import Sequence

from resihp.errors import InputError


def balanced_layers(layers: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges ``[first, last)``, one per stage, sizes differing by at most one."""
    if pp > layers:
        raise InputError(f"--pp {pp}: cannot split {layers} layers into {pp} non-empty stages")
    base, extra = divmod(layers, pp)
    ranges, first = [], 0
    for stage in range(pp):
        last = first + base + (1 if stage < extra else 0)
        ranges.append((first, last))
        first = last
    return ranges


def parse_layer_split(text: str, layers: int, pp: int) -> list[tuple[int, int]]:
    """``"3,2,2,1"`` (layers per stage) into contiguous ranges covering ``[0, layers)``.

    Args:
        text: the layer counts, comma-separated (``--layer-split``).
        layers: the model's layers.
        pp: the pipeline's stages."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(
            f"--layer-split {text!r}: expected comma-separated layer counts, e.g. 2,2"
        ) from None
    return ranges_from_counts(counts, layers, pp, source=f"--layer-split {text!r}")


def ranges_from_counts(
    counts: Sequence[int], layers: int, pp: int, source: str = "layer split"
) -> list[tuple[int, int]]:
    """Layer counts per stage into contiguous ranges covering ``[0, layers)``, checked.

    Args:
        counts: each stage's layer count (positive).
        layers: the model's layers (the counts' sum).
        pp: the pipeline's stages (the counts' number).
        source: what the counts came from, named in the error."""
    if len(counts) != pp or any(c < 1 for c in counts) or sum(counts) != layers:
        raise InputError(
            f"{source}: expected {pp} positive layer counts summing to {layers}, got {list(counts)}"
        )
    ranges, first = [], 0
    for c in counts:
        ranges.append((first, first + c))
        first += c
    return ranges
