"""Checkpoints keyed by global names, independent of the parallel layout.

Keys: ``model.<global name>`` and ``optim.<global name>.<step|exp_avg|exp_avg_sq>``. A tensor-parallel
shard is saved as ``<key>@tp<rank>of<size>``; ``convert`` joins the shards into whole tensors (the
universal form any layout can load). Replicas of the same key on several data-parallel ranks are
written once (torch.distributed.checkpoint de-duplicates them). Beside the tensors, ``meta.json``
holds the step and the layout that wrote it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from resihp.errors import InputError
from resihp.runtime.replan import ADAM_KEYS
from resihp.runtime.tensor_parallel import full_shape, shard, split_of, unshard


def _key(name: str, tp_rank: int, tp: int) -> str:
    return f"{name}@tp{tp_rank}of{tp}" if tp > 1 and split_of(name) else name


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tp_rank: int = 0,
             tp: int = 1) -> dict[str, torch.Tensor]:
    """This rank's tensors under their universal keys (views of the live tensors)."""
    out = {}
    for name, p in model.named_parameters():
        key = _key(name, tp_rank, tp)
        out[f"model.{key}"] = p.detach()
        state = optimizer.state.get(p, {})
        for k in ADAM_KEYS:
            value = state.get(k)
            if value is None:
                value = torch.zeros(() if k == "step" else p.shape)
                state[k] = value
                optimizer.state[p] = state
            out[f"optim.{key}.{k}"] = value
    return out


def save(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         step: int, meta: dict, tp_rank: int = 0, tp: int = 1) -> None:
    """Collective: every rank of the job calls it. Rank 0 also writes ``meta.json``."""
    directory = Path(directory)
    dcp.save(state_of(model, optimizer, tp_rank, tp), checkpoint_id=str(directory))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        (directory / "meta.json").write_text(json.dumps({"step": step, **meta}))


def load(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         tp_rank: int = 0, tp: int = 1) -> dict:
    """Fill this rank's parameters and AdamW state from ``directory``; returns its meta."""
    meta = read_meta(directory)
    saved_tp = int(meta.get("tp", 1))
    if saved_tp != tp and saved_tp > 1:
        raise InputError(f"{directory}: written with tp={saved_tp}; run `resihp ckpt convert` to "
                         f"make a universal checkpoint before loading it with tp={tp}")
    for p in model.parameters():  # AdamW state must exist to be loaded into
        optimizer.state.setdefault(p, {})
    live = state_of(model, optimizer, tp_rank, tp)
    if saved_tp == tp:
        targets = live
        wanted = {k: torch.empty_like(v) for k, v in live.items()}
    else:  # a universal checkpoint into a tensor-parallel layout: load whole tensors, keep a slice
        targets = {re.sub(r"@tp\d+of\d+", "", k): v for k, v in live.items()}
        wanted = {k: torch.empty(full_shape(_param_name(k), v.shape, tp) if v.dim() else ())
                  for k, v in targets.items()}
    dcp.load(wanted, checkpoint_id=str(directory))
    heads = model.cfg.heads if hasattr(model, "cfg") else 1
    with torch.no_grad():
        for k, v in wanted.items():
            value = v if targets[k].shape == v.shape else shard(_param_name(k), v, tp, tp_rank, heads)
            targets[k].copy_(value)
    return meta


def _param_name(key: str) -> str:
    """``model.X`` / ``optim.X.exp_avg`` -> ``X``."""
    name = re.sub(r"^(model|optim)\.", "", key)
    return re.sub(r"\.(step|exp_avg|exp_avg_sq)$", "", name) if key.startswith("optim.") else name


def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / "meta.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{directory}: not a resihp checkpoint (no meta.json)") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg})") from None


def inspect(directory: str | Path) -> dict:
    """What a checkpoint holds: its meta, and each key's shape and dtype."""
    meta = read_meta(directory)
    try:
        md = FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # torch raises several types for a missing or foreign .metadata
        raise InputError(f"{directory}: cannot read checkpoint metadata ({type(exc).__name__})") from None
    keys = {k: {"shape": list(getattr(v, "size", [])), "dtype": str(getattr(getattr(v, "properties", None), "dtype", ""))}
            for k, v in md.state_dict_metadata.items()}
    layers = sorted({int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k))})
    return {"meta": meta, "tensors": len(keys), "layers": layers, "keys": keys}


def convert(src: str | Path, dst: str | Path) -> dict:
    """Join tensor-parallel shards into whole tensors: a universal checkpoint (single process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = read_meta(src)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    flat_path = dst / "flat.pt"
    dcp_to_torch_save(str(src), str(flat_path))
    flat = torch.load(flat_path, weights_only=True)
    flat_path.unlink()
    heads = int(meta.get("model", {}).get("heads", 1))
    groups: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, value in flat.items():
        m = re.match(r"^(.*)@tp(\d+)of(\d+)(\..*)?$", key)
        if m:
            groups.setdefault(m.group(1) + (m.group(4) or ""), {})[int(m.group(2))] = value
        else:
            out[key] = value
    for key, pieces in groups.items():
        name = _param_name(key)
        ordered = [pieces[i] for i in sorted(pieces)]
        out[key] = ordered[0] if key.endswith(".step") else unshard(name, ordered, heads)
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    tmp = dst / "universal.pt"
    torch.save(out, tmp)
    torch_save_to_dcp(str(tmp), str(dst))
    tmp.unlink()
    (dst / "meta.json").write_text(json.dumps({**meta, "tp": 1, "converted_from": str(src)}))
    return {"tensors": len(out), "joined": len(groups)}
