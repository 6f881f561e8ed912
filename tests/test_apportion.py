"""``resihp.parallel.apportion``: the one integer split of layers and micro-batches."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from resihp.errors import InputError
from resihp.parallel import apportion


def test_largest_remainder_and_ties_to_the_first():
    assert apportion(10, [1, 1, 2]) == [3, 2, 5]
    assert apportion(7, np.ones(3)) == [3, 2, 2]  # equal weights: the larger counts first
    assert apportion(32, np.ones(3), minimum=1) == [11, 11, 10]
    assert apportion(100, [1.0, 2.0, 1.0]) == [25, 50, 25]
    assert apportion(0, [1, 2]) == [0, 0]


def test_minimum_and_caps():
    out = apportion(20, [1.0, 1.0, 10.0], caps=[10, 10, 8])
    assert out == [6, 6, 8]
    # a part held up to the minimum does not also win a remainder
    assert apportion(4, [0.95, 1.5, 1.55], minimum=1) == [1, 1, 2]
    assert apportion(3, [0.01, 0.01, 10], minimum=1) == [1, 1, 1]
    assert sum(apportion(10, [1, 1], caps=[3, 3])) == 6  # the caps do not allow the total


@pytest.mark.parametrize("weights", [[], [0, 0], [1, -1], [1, float("nan")]])
def test_bad_weights_name_what(weights):
    with pytest.raises(InputError, match="micro-batch weights must be non-negative"):
        apportion(4, weights, what="micro-batch weights")


@given(
    st.integers(0, 300),
    st.lists(st.floats(0, 10), min_size=1, max_size=12),
    st.integers(0, 2),
    st.booleans(),
)
def test_sums_to_total_within_one_of_the_share(total, weights, minimum, capped):
    if sum(weights) <= 0:
        return
    n = len(weights)
    caps = [max(minimum, total // 2)] * n if capped else None
    out = apportion(total, weights, minimum=minimum, caps=caps)
    assert len(out) == n and min(out) >= min(minimum, max(caps or [minimum]))
    if caps is not None:
        assert all(c <= cap for c, cap in zip(out, caps))
    room = sum(caps) if caps is not None else total
    if n * minimum <= total <= room:
        assert sum(out) == total
    if caps is None and minimum == 0:
        share = np.array(weights) * total / sum(weights)
        assert np.all(np.abs(np.array(out) - share) < 1 + 1e-9)
