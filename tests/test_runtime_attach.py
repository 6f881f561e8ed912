import torch
from torch import nn

import resihp
from resihp.opstrace import read_meta


def test_attach_records_ops_without_changing_training(tmp_path):
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))  # noqa: E731
    plain, watched = make(), make()
    watched.load_state_dict(plain.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, watched)]
    mon = resihp.attach(watched, optimizer=opts[1], out=tmp_path, model_name="toy")
    losses = {0: [], 1: []}
    for step in range(3):
        ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(step))
        for i, (model, opt) in enumerate(zip((plain, watched), opts)):
            ctx = mon.step(seq_lens=[9, 9]) if i else torch.enable_grad()
            with ctx:
                loss = nn.functional.cross_entropy(model(ids).reshape(-1, 50), ids.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses[i].append(loss.item())
    mon.close()
    assert losses[0] == losses[1]
    trace = mon.trace()
    assert sorted(trace.optype.unique()) == ["backward-compute", "forward-compute", "optimizer", "step"]
    assert (trace.groupby("step").size() == 4).all()
    fwd = trace[trace.optype == "forward-compute"]
    assert fwd.seq_lens.map(list).tolist() == [[9, 9]] * 3 and (fwd.tokens == 18).all()
    # the backward ends before the optimizer starts, the forward before the backward
    for _, rows in trace.groupby("step"):
        t = rows.set_index("optype")
        assert t.start_ts["forward-compute"] <= t.start_ts["backward-compute"] <= t.start_ts["optimizer"]
    assert (tmp_path / "ranks" / "rank0.jsonl").exists() and (tmp_path / "ops.rank0.parquet").exists()
    meta, extra = read_meta(tmp_path / "job.yaml")
    assert meta.world_size == 1 and extra["model_name"] == "toy"
    # hooks are gone after close
    assert not watched._forward_hooks and not watched._forward_pre_hooks
