"""--inject link:ranks=A+B: parsing, and the delay it adds to each transfer between A and B."""

import pytest

from resihp.errors import InputError
from resihp.train.inject import FaultInjector, check_faults, parse_fault


def test_parse_link_fault():
    f = parse_fault("link:ranks=0+2,factor=5,step=3,until=9")
    assert (f.kind, f.ranks, f.factor, f.step, f.until) == ("link", (0, 2), 5.0, 3, 9)
    assert f.to_dict() == {"kind": "link", "step": 3, "factor": 5.0, "until": 9, "ranks": [0, 2]}


@pytest.mark.parametrize(
    "text, words",
    [
        ("link:rank=0,factor=2,step=1", r"ranks=A\+B \(its two ends\)"),
        ("link:ranks=1+1,factor=2,step=1", "two different ranks"),
        ("link:ranks=1,factor=2,step=1", "two different ranks"),
        ("link:ranks=a+b,factor=2,step=1", "two different ranks"),
        ("link:ranks=0+1,factor=0.5,step=1", "factor must be >= 1"),
        ("link:ranks=0+1,factor=2", "exactly one of step= or time="),
        ("link:ranks=0+1,factor=2,step=1,how=stop", "how= is for hang only"),
        ("slow:ranks=0+1,factor=2,step=1", "is for link only"),
    ],
)
def test_bad_link_faults_name_the_form(text, words):
    with pytest.raises(InputError, match=words):
        parse_fault(text)


def test_link_end_outside_the_world():
    with pytest.raises(InputError, match="no such rank 4"):
        check_faults([parse_fault("link:ranks=1+4,factor=2,step=1")], 4)


def _injector(rank, text="link:ranks=0+2,factor=4,step=2,until=5"):
    slept = []
    return FaultInjector([parse_fault(text)], rank, sleep=slept.append), slept


def test_receives_over_the_slow_link_wait_in_proportion_to_their_bytes():
    inj, slept = _injector(0)
    inj.begin_step(1)
    for ms in (10, 50, 12, 80, 11, 90, 13, 60, 10, 70, 14):  # healthy: 10 us per byte, or waited
        inj.received(2, ms / 1000, 1000)
    assert slept == []
    inj.begin_step(2)
    inj.received(2, 0.020, 1000)  # the healthy rate (a low quantile, without waits) x bytes
    inj.received(2, 0.500, 1000)  # waited on its sender: only its transfer counts
    inj.received(2, 0.001, 4000)  # four times the bytes, four times the delay
    assert slept == pytest.approx([3 * 0.010, 3 * 0.010, 3 * 0.040])
    inj.received(1, 0.010, 1000)  # another peer: its own link is healthy
    assert len(slept) == 3
    assert inj.delayed_s == pytest.approx(0.18)


def test_only_the_two_ends_and_only_between_step_and_until():
    inj, slept = _injector(0)
    inj.begin_step(1)
    inj.received(2, 0.010, 1000)  # before the onset: measured, not delayed
    inj.begin_step(5)
    inj.received(2, 0.010, 1000)  # at until: healthy again
    assert slept == []
    other, slept_other = _injector(1)
    other.begin_step(3)
    other.received(2, 0.010, 1000)
    assert slept_other == []


def test_collectives_both_ends_join_are_stretched_on_both_ends():
    for rank in (0, 2):
        inj, slept = _injector(rank)
        inj.begin_step(3)
        inj.collective((0, 1, 2, 3), 0.008, 2000)
        inj.collective((0, 1), 0.008, 2000) if rank == 0 else inj.collective((2, 3), 0.008, 2000)
        assert slept == pytest.approx([3 * 0.008])
    inj, slept = _injector(1)
    inj.begin_step(3)
    inj.collective((0, 1, 2, 3), 0.008, 2000)
    assert slept == []
