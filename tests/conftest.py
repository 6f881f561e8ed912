import numpy as np
import pytest
import torch


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory):
    """A real profiling log of a tiny decoder stack (seconds to measure)."""
    from resihp.model.gpt import GPTConfig
    from resihp.perf.profiler import profile
    from resihp.workload.lengths import resolve_source, sample_sequences
    from resihp.workload.packing import pack_greedy

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    batches = []
    for source in ("code", "text"):
        seqs = sample_sequences(resolve_source(source), 30 * 256, 256, rng)
        batches += pack_greedy(seqs, 256)[:30]
    cfg = GPTConfig(layers=1, hidden=64, heads=2, ffn_hidden=128, max_seq_len=256)
    log = profile(cfg, batches, repeats=2, warmup=1, model_name="tiny")
    log["budget"] = 256
    path = tmp_path_factory.mktemp("profile") / "tiny.parquet"
    log.to_parquet(path, index=False)
    return path
