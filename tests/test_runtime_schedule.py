import pytest
from hypothesis import given
from hypothesis import strategies as st

from resihp.errors import InputError
from resihp.parallel import ParallelDims
from resihp.train.data import DataSource, replica_microbatches
from resihp.train.layout import balanced_layers, parse_layer_split
from resihp.train.schedule import gpipe, one_f_one_b, schedule_for


def simulate(schedule, pp: int, n_mb: int) -> int:
    """Run the schedule with blocking receives and asynchronous sends; return how many actions
    ran (all of them unless the schedule deadlocks)."""
    plans = [schedule(pp, s, n_mb) for s in range(pp)]
    pos = [0] * pp
    fwd_done, bwd_done = set(), set()  # (stage, mb)
    progress = True
    while progress:
        progress = False
        for s in range(pp):
            if pos[s] == len(plans[s]):
                continue
            a = plans[s][pos[s]]
            ready = (
                (s == 0 or (s - 1, a.mb) in fwd_done)
                if a.kind == "F"
                else (s, a.mb) in fwd_done and (s == pp - 1 or (s + 1, a.mb) in bwd_done)
            )
            if ready:
                (fwd_done if a.kind == "F" else bwd_done).add((s, a.mb))
                pos[s] += 1
                progress = True
    return sum(pos)


@given(st.integers(1, 6), st.integers(0, 12))
def test_schedules_complete_without_deadlock(pp, n_mb):
    for schedule in (gpipe, one_f_one_b):
        assert simulate(schedule, pp, n_mb) == 2 * pp * n_mb


@given(st.integers(1, 6), st.integers(0, 12))
def test_one_f_one_b_bounds_activations_in_flight(pp, n_mb):
    for stage in range(pp):
        actions = one_f_one_b(pp, stage, n_mb)
        assert sorted((a.kind, a.mb) for a in actions) == sorted(
            [("F", m) for m in range(n_mb)] + [("B", m) for m in range(n_mb)]
        )
        in_flight = peak = 0
        for a in actions:
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak <= min(pp - stage, n_mb)


def test_unknown_schedule_is_input_error():
    with pytest.raises(InputError, match="--schedule"):
        schedule_for("zigzag", 2, 0, 4)


def test_rank_layout_round_trips():
    dims = ParallelDims(dp=2, pp=3, tp=2)
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert dims.rank_of(c.dp_rank, c.stage, c.tp_rank) == rank
        seen.add((c.dp_rank, c.stage, c.tp_rank))
    assert len(seen) == 12
    with pytest.raises(InputError, match="world has 5 processes"):
        dims.check_world(5)


def test_layer_splits():
    assert balanced_layers(5, 2) == [(0, 3), (3, 5)]
    assert parse_layer_split("1,3", 4, 2) == [(0, 1), (1, 4)]
    with pytest.raises(InputError, match="summing to 4"):
        parse_layer_split("2,3", 4, 2)
    with pytest.raises(InputError, match="non-empty stages"):
        balanced_layers(2, 3)


def test_step_data_is_deterministic_and_real():
    src = DataSource("text", global_tokens=8192, budget=2048, max_len=1024, seed=3)
    a, b = src.step(7), src.step(7)
    assert a == b and a != src.step(8)
    assert a.tokens <= 8192 and all(mb.tokens <= 2048 for mb in a.microbatches)
    assert len({len(mb.seq_lens) for mb in a.microbatches}) > 1  # a real mix of packings
    x1, y1 = src.tokens(7, a.microbatches[0], vocab=100)
    x2, _ = src.tokens(7, a.microbatches[0], vocab=100)
    assert x1.equal(x2) and x1.shape == y1.shape == (a.microbatches[0].tokens,)
    runs = [replica_microbatches(a, d, [2, 1]) for d in range(2)]
    assert [mb.mb_id for r in runs for mb in r] == list(range(len(a.microbatches)))


def test_data_source_rejects_bad_sizes():
    with pytest.raises(InputError, match="--max-len 1024 exceeds"):
        DataSource("text", global_tokens=4096, budget=512, max_len=1024, seed=0)
    with pytest.raises(InputError, match="length source"):
        DataSource("nope", global_tokens=4096, budget=512, max_len=512, seed=0)


def test_tensor_parallel_shards_round_trip():
    import torch

    from resihp.model.config import GPTConfig
    from resihp.model.gpt import GPTStage, init_by_name
    from resihp.model.tensor_parallel import TPContext, shard, unshard

    cfg = GPTConfig(layers=1, hidden=32, heads=4, ffn_hidden=64, vocab=50)
    full = GPTStage(cfg)
    init_by_name(full, 7)
    parts = []
    for r in range(2):
        part = GPTStage(cfg, tp=TPContext(2, r))
        init_by_name(part, 7, TPContext(2, r), cfg.heads)
        parts.append(dict(part.named_parameters()))
    for name, p in full.named_parameters():
        assert torch.equal(unshard(name, [parts[0][name], parts[1][name]], cfg.heads), p), name
        assert torch.equal(shard(name, p, 2, 1, cfg.heads), parts[1][name]), name
