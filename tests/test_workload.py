import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from resihp.errors import InputError
from resihp.workload.features import (
    LengthTable,
    PooledLengths,
    length_feature_arrays,
    length_features,
)
from resihp.workload.flops import TransformerShape, stage_flops
from resihp.workload.lengths import chunk_documents, load_lengths, resolve_source, sample_sequences
from resihp.workload.packing import pack_greedy


@given(st.lists(st.integers(1, 512), min_size=1, max_size=200), st.integers(512, 4096))
def test_packing_keeps_order_and_budget(lengths, budget):
    batches = pack_greedy(lengths, budget)
    assert np.concatenate(batches).tolist() == lengths
    assert all(b.sum() <= budget for b in batches)
    # greedy: the next micro-batch's first sequence did not fit into the previous one
    for prev, nxt in zip(batches, batches[1:]):
        assert prev.sum() + nxt[0] > budget


def test_packing_rejects_sequence_over_budget():
    with pytest.raises(InputError, match="exceeds the micro-batch token budget 100"):
        pack_greedy([10, 101], 100)


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=50), st.integers(1, 2048))
def test_chunking_preserves_tokens(lengths, max_len):
    chunks = chunk_documents(np.array(lengths), max_len)
    assert chunks.sum() == sum(lengths)
    assert chunks.max() <= max_len and chunks.min() >= 1


def test_features_match_definition():
    feats = length_features([[3, 4], [5]])
    assert feats["tokens"].tolist() == [7, 5]
    assert feats["sum_sq"].tolist() == [25, 25]
    assert feats["n_seqs"].tolist() == [2, 1]
    assert feats["max_len"].tolist() == [4, 5]


lists_of_lengths = st.lists(
    st.lists(st.integers(1, 4096), min_size=1, max_size=6), min_size=1, max_size=12
)


@given(lists_of_lengths, lists_of_lengths, st.data())
def test_pooled_lengths_are_the_rows_they_code(pool_a, pool_b, data):
    """A column of codes into tables: its rows, slices, features and concatenation (of one table
    or two) are those of the object column it stands for, bit for bit."""
    tables = LengthTable([np.array(s) for s in pool_a]), LengthTable([np.array(s) for s in pool_b])
    parts = []
    for table, pool in zip(tables, (pool_a, pool_b)):
        codes = np.array(
            data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=30))
        )
        parts.append((PooledLengths(table, codes), [pool[c] for c in codes]))
    for col, rows in [
        *parts,
        (PooledLengths.concatenate([parts[0][0], parts[0][0]]), parts[0][1] * 2),
        (PooledLengths.concatenate([p for p, _ in parts]), parts[0][1] + parts[1][1]),
    ]:
        assert len(col) == len(rows)
        assert [list(col[i]) for i in range(len(col))] == rows
        assert [list(s) for s in np.asarray(col)] == rows
        want = length_feature_arrays(rows)
        for name, got in length_feature_arrays(col).items():
            np.testing.assert_array_equal(got, want[name])
        picked = np.arange(len(col))[::2]
        assert [list(s) for s in col[picked].objects()] == rows[::2]
    one = PooledLengths.concatenate([parts[0][0], parts[0][0]])
    assert one.table is tables[0]  # rows of one table stay codes into it


def test_attention_flops_grow_with_sum_of_squares():
    shape = TransformerShape(layers=2, hidden=64, heads=4, ffn_hidden=256)
    dense, attn = stage_flops(shape, np.array([1024, 1024]), np.array([1024**2, 4 * 256**2]))
    assert dense[0] == dense[1] and attn[0] > 3.5 * attn[1]
    dense_b, attn_b = stage_flops(shape, np.array([1024]), np.array([1024**2]), "bwd")
    assert dense_b[0] == 2 * dense[0] and attn_b[0] == 2 * attn[0]


def test_real_sources_are_shipped():
    for name in ("code", "text"):
        lengths = resolve_source(name)
        assert len(lengths) > 500 and lengths.min() > 0
    seqs = sample_sequences(resolve_source("text"), 10_000, 512, np.random.default_rng(0))
    assert seqs.max() <= 512 and seqs.sum() >= 10_000


@pytest.mark.parametrize(
    "content, message",
    [
        ("12\nabc\n", "line per line|expected one integer"),
        ("12\n-3\n", "must be positive"),
        ("# nothing\n", "no sequence lengths"),
    ],
)
def test_bad_lengths_files(tmp_path, content, message):
    path = tmp_path / "lengths.txt"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        load_lengths(path)
