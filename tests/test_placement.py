"""The job's placement: one type (``resihp.parallel.Placement``) with one JSON form, read from both
forms a plan change may carry, made by the planner's plans and the rank's elastic restart."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resihp.errors import InputError
from resihp.parallel import ParallelDims, Placement
from resihp.plan.plan import Pipeline, Plan, Stage
from resihp.train.planchange import PlanChange


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.randoms())
def test_the_uniform_shorthand_and_the_json_form_are_one_placement(dp, pp, tp, rnd):
    dims = ParallelDims(dp, pp, tp)
    ranks = list(range(dims.world_size + 2))
    rnd.shuffle(ranks)
    ranks = ranks[: dims.world_size]
    short = Placement.parse({"dp": dp, "pp": pp, "tp": tp, "ranks": ranks}, dims.world_size + 2)
    assert Placement.parse(short.to_dict(), dims.world_size + 2) == short
    assert sorted(short.ranks) == sorted(ranks)
    assert short.depths == [pp] * dp
    for r, c in short.coords().items():
        assert ranks.index(r) == dims.rank_of(c.dp_rank, c.stage, c.tp_rank)
    assert short.spares(dims.world_size + 2) == sorted(set(range(dims.world_size + 2)) - set(ranks))


def test_a_heterogeneous_placement_keeps_its_shape_and_leaves_spares():
    p = Placement.parse({"pipelines": [[[0, 1], [2]], [[3], [4], [5]]]}, world=7)
    assert p.depths == [2, 3] and p.spares(7) == [6]
    assert p.coords()[1].tp_rank == 1 and p.coords()[5].stage == 2
    assert p.to_dict() == {"pipelines": [[[0, 1], [2]], [[3], [4], [5]]]}


@pytest.mark.parametrize(
    "data, match",
    [
        ([[0]], "expected"),
        ({"pipelines": []}, "expected"),
        ({"pipelines": [[[0], []]]}, "expected"),
        ({"pipelines": [[[0, 0]]]}, "distinct world ranks in \\[0, 4\\)"),
        ({"pipelines": [[[9]]]}, "distinct world ranks in \\[0, 4\\)"),
        ({"pipelines": [[["a"]]]}, "distinct world ranks"),
        ({"dp": 2, "pp": 1, "ranks": [0]}, "expected 2 world ranks"),
        ({"dp": "x"}, "expected"),
    ],
)
def test_a_bad_placement_is_one_line_naming_where(data, match):
    with pytest.raises(InputError, match=match) as err:
        Placement.parse(data, world=4, where="plan.json")
    assert str(err.value).startswith("plan.json layout") and "\n" not in str(err.value)


def test_a_plan_gives_its_placement_and_a_change_made_from_it_reads_back_equal():
    pipes = [
        Pipeline(1, (Stage((3,), (0, 2)), Stage((4, 5), (2, 4))), 3),
        Pipeline(0, (Stage((0, 1), (0, 4)),), 5),
    ]
    plan = Plan(6, ParallelDims(2, 2), pipes, excluded=[2])
    assert plan.placement == Placement((((0, 1),), ((3,), (4, 5))))
    made = PlanChange(dp_weights=(5.0, 3.0), layer_splits=((4,), (2, 2)), layout=plan.placement)
    wire = made.to_dict()
    assert wire == {
        "dp_weights": [5.0, 3.0],
        "layer_splits": [[4], [2, 2]],
        "layout": {"pipelines": [[[0, 1]], [[3], [4, 5]]]},
    }
    back = PlanChange.parse(wire, ParallelDims(2, 2), layers=4, world=6, depths=[1, 2])
    assert back == made and back.to_dict() == wire
