"""Unbounded knapsack (any number of each item) over small integer costs, vectorised with NumPy.

The capacity bound prices pipeline designs with it, the designed plans choose theirs with it."""

from __future__ import annotations

import numpy as np


def unbounded_knapsack(
    cost: np.ndarray, value: np.ndarray, capacity: int, tables: list[np.ndarray] | None = None
) -> np.ndarray:
    """best[c] = the largest total value of items (any number of each) of total cost <= c.

    Args:
        cost: each item's integer cost.
        value: each item's value.
        capacity: the largest total cost.
        tables: if given, receives the table after each item (``choose`` reads them).
    """
    best = np.zeros(capacity + 1)
    for w, v in zip(np.asarray(cost).tolist(), np.asarray(value).tolist()):
        w = int(w)
        if v > 0 and 0 < w <= capacity:
            n = -(-(capacity + 1) // w)
            padded = np.full(n * w, -np.inf)
            padded[: capacity + 1] = best
            grid = padded.reshape(n, w)  # grid[j, r] = best[j * w + r]
            j = np.arange(n)[:, None] * v
            best = (np.maximum.accumulate(grid - j, axis=0) + j).reshape(-1)[: capacity + 1]
        if tables is not None:
            tables.append(best)
    return np.maximum.accumulate(best)


def choose(cost: np.ndarray, value: np.ndarray, capacity: int) -> tuple[float, list[int]]:
    """The best packing itself: (its value, how many of each item).

    Args:
        cost: each item's integer cost.
        value: each item's value.
        capacity: the largest total cost.
    """
    tables: list[np.ndarray] = []
    unbounded_knapsack(cost, value, capacity, tables)
    counts = [0] * len(tables)
    if not tables:
        return 0.0, counts
    c = int(np.argmax(tables[-1]))
    total = float(tables[-1][c])
    for i in range(len(tables) - 1, -1, -1):
        prev = tables[i - 1] if i else np.zeros(capacity + 1)
        w, v = int(cost[i]), float(value[i])
        # the fewest of item i that, with the items before it, reach this table's value at c
        # (within rounding; the most valuable count if rounding hid every one)
        ks = np.arange(c // w + 1) if v > 0 and 0 < w <= capacity else np.zeros(1, dtype=int)
        got = prev[c - ks * w] + ks * v
        reach = np.flatnonzero(got >= tables[i][c] - 1e-12 * max(1.0, abs(tables[i][c])))
        k = int(ks[reach[0]] if len(reach) else ks[np.argmax(got)])
        counts[i] = k
        c -= k * w
    return total, counts
