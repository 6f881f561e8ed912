"""A plan change is checked once against the job (resihp.train.planchange)."""

import pytest

from resihp.errors import InputError
from resihp.parallel import ParallelDims
from resihp.train.planchange import PlanChange

DIMS = ParallelDims(dp=2, pp=2)


def test_one_split_for_every_pipeline_or_one_per_replica():
    one = PlanChange.parse({"version": 3, "layer_split": [3, 1], "dp_weights": [2, 1]}, DIMS, 4)
    assert one.layer_splits == ((3, 1), (3, 1)) and one.dp_weights == (2.0, 1.0)
    assert one.replica_ranges(4, 2) == [[(0, 3), (3, 4)], [(0, 3), (3, 4)]]
    each = PlanChange.parse({"layer_splits": [[2, 2], [1, 3]], "reason": {"rank": 1}}, DIMS, 4)
    assert each.replica_ranges(4, 2) == [[(0, 2), (2, 4)], [(0, 1), (1, 4)]]
    assert each.dp_weights is None and each.to_dict()["reason"] == {"rank": 1}
    assert PlanChange.parse({"version": 1}, DIMS, 4).replica_ranges(4, 2) is None


@pytest.mark.parametrize(
    "change,message",
    [
        ({"layer_splits": [[2, 2]]}, "plan layer_splits: expected 2 splits, got 1"),
        ({"layer_split": [2, 1]}, "expected 2 positive layer counts summing to 4"),
        ({"layer_split": [4, 0]}, "expected 2 positive layer counts"),
        ({"dp_weights": [1, 1, 1]}, "plan dp_weights: expected 2 non-negative weights"),
        ({"dp_weights": [0, 0]}, "positive sum"),
        ({"dp_weights": ["a", 1]}, "plan dp_weights"),
    ],
)
def test_a_change_that_does_not_fit_the_job_is_one_line(change, message):
    with pytest.raises(InputError, match=message):
        PlanChange.parse(change, DIMS, 4)
