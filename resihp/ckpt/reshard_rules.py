"""How each piece of non-tensor state crosses a layout change.

Kept exactly, re-derived for the new layout, or refused with a message that names it (never
silently wrong).

A checkpoint's ``meta.json`` records the values under ``state``; a resuming run gives its own, and
``decide`` returns one decision per key (what ``resihp run --resume`` records in the run folder's
``resume.json``) or raises ``InputError`` for the first refused one.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from resihp.errors import InputError

KEPT, REDERIVED, REFUSED = "kept", "re-derived", "refused"


@dataclass(frozen=True)
class Rule:
    key: str
    rule: str  # kept | re-derived | refused (when the resuming run's value differs)
    why: str
    flag: str = ""  # the resuming run's flag that sets it


RULES = (
    Rule("step", KEPT, "the run goes on at the checkpoint's step + 1; --steps stays the total"),
    Rule(
        "data.cursor",
        KEPT,
        "each step's documents are drawn from (seed, step) alone, so the next "
        "step's global batch is the same in any layout",
    ),
    Rule(
        "data.seed",
        REFUSED,
        "another seed draws other documents and another initialisation",
        "--seed",
    ),
    Rule("data.source", REFUSED, "another length source draws other documents", "--source"),
    Rule(
        "data.global_tokens",
        REFUSED,
        "another global batch changes the optimizer's mathematics",
        "--global-tokens",
    ),
    Rule(
        "data.max_len",
        REFUSED,
        "another longest sequence chunks documents differently",
        "--max-len",
    ),
    Rule(
        "data.budget",
        REDERIVED,
        "the same documents are packed into micro-batches under the new "
        "budget (the loss is a sum over the global batch's tokens)",
        "--budget",
    ),
    Rule(
        "data.dp_weights",
        REDERIVED,
        "each replica's share of the micro-batches follows the new layout",
        "--dp-weights",
    ),
    Rule("layer_splits", REDERIVED, "layers per stage follow the new layout", "--layer-split"),
    Rule(
        "optim.lr",
        REDERIVED,
        "the learning rate is the resuming run's (AdamW keeps no rate)",
        "--lr",
    ),
    Rule(
        "rng.torch",
        KEPT,
        "each rank's torch generator state is restored in the same layout; in another one it is "
        "re-derived from (seed, step, the rank's data/pipeline/tensor coordinates), as no rank's "
        "stream maps onto a rank of the new layout",
    ),
)


def state_of_run(
    seed: int,
    source: str,
    global_tokens: int,
    max_len: int,
    budget: int,
    dp_weights: list[float],
    layer_splits: list[list[int]],
    lr: float,
    layout: dict[str, int],
) -> dict:
    """The non-tensor state of a run as a checkpoint's ``meta.json`` records it.

    Args:
        seed: the run's seed.
        source: the sequence-length source.
        global_tokens: tokens a step.
        max_len: the model's longest sequence.
        budget: tokens per micro-batch.
        dp_weights: each replica's share of the global batch.
        layer_splits: each replica's layers per stage.
        lr: the learning rate.
        layout: the layout in force (``pipelines``: the ranks of each pipeline's stages).
    """
    return {
        "data.seed": seed,
        "data.source": source,
        "data.global_tokens": global_tokens,
        "data.max_len": max_len,
        "data.budget": budget,
        "data.dp_weights": list(dp_weights),
        "layer_splits": [list(s) for s in layer_splits],
        "optim.lr": lr,
        "layout": dict(layout),
    }


def same_layout(saved: dict, now: dict) -> bool:
    return saved.get("layout") == now.get("layout") and saved.get("layer_splits") == now.get(
        "layer_splits"
    )


def decide(saved: dict, now: dict, source: str = "checkpoint") -> list[dict]:
    """Per key of ``RULES``: the rule applied, the saved value and the resuming run's.

    Raises InputError naming the flag for a refused key whose value differs.

    Args:
        saved: the checkpoint's state (``state_of_run``).
        now: the resuming run's state.
        source: what the error names as the checkpoint.
    """
    decisions = []
    for rule in RULES:
        before, after = saved.get(rule.key), now.get(rule.key)
        applied = rule.rule
        if rule.key == "rng.torch" and not same_layout(saved, now):
            applied = REDERIVED
        if rule.rule == REFUSED:
            if before is None:
                applied = "unchecked (older checkpoint)"
            elif before != after:
                raise InputError(
                    f"{source}: written with {rule.flag} {before}, this run has {after}: "
                    f"{rule.why}; resume with {rule.flag} {before}"
                )
            else:
                applied = KEPT
        decisions.append({"key": rule.key, "rule": applied, "saved": before, "now": after})
    return decisions


def derived_seed(seed: int, step: int, coords: tuple[int, ...]) -> int:
    """A torch generator seed for a rank of a new layout at ``step``.

    Args:
        seed: the run's seed.
        step: the step the new layout starts at.
        coords: the rank's coordinates (data, pipeline, tensor) in the new layout.
    """
    return zlib.crc32(repr((seed, step, tuple(coords))).encode())
