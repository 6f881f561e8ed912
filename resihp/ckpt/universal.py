"""Checkpoints keyed by global names, independent of the parallel layout.

Keys: ``model.<global name>`` and ``optim.<global name>.<step|exp_avg|exp_avg_sq>``. A tensor-parallel
shard is saved as ``<key>@tp<rank>of<size>``; ``convert`` joins the shards into whole tensors (the
universal form any layout can load). Replicas of the same key on several data-parallel ranks are
written once (torch.distributed.checkpoint de-duplicates them). Beside the tensors, ``meta.json``
holds the step, the layout that wrote it, the job id and the model hash; ``manifest.json`` (written
last, see :mod:`resihp.ckpt.integrity`) lists every file with its sha256. Nothing is read from a
checkpoint whose manifest does not verify, and DCP's pickled metadata only through a restricted
unpickler.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from resihp.ckpt.integrity import newest_good, publish, read_dcp_metadata, safe_reader, verify
from resihp.errors import InputError
from resihp.model.gpt import ADAM_KEYS
from resihp.model.tensor_parallel import full_shape, shard, split_of, unshard


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
    """Collective: every rank of the job calls it. The tensors go to a hidden temporary folder;
    rank 0 (whose DCP call returns only after every rank's files are written) adds ``meta.json``
    and the manifest, and renames the folder to ``directory``."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.partial")
    dcp.save(state_of(model, optimizer, tp_rank, tp), checkpoint_id=str(tmp))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        meta = {"step": step, **meta}
        (tmp / "meta.json").write_text(json.dumps(meta))
        publish(tmp, directory, identity(meta))


def identity(meta: dict) -> dict:
    """What the manifest records of the job that wrote a checkpoint."""
    return {k: meta.get(k) for k in ("job_id", "model_hash", "step")}


def load(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         tp_rank: int = 0, tp: int = 1) -> dict:
    """Fill this rank's parameters and AdamW state from ``directory`` (which must verify against
    its manifest); returns its meta."""
    verify(directory)
    read_dcp_metadata(directory)  # refused here, with its reason, rather than inside DCP's load
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
    dcp.load(wanted, storage_reader=safe_reader(directory))
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


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder meaning its newest checkpoint that verifies."""
    path = Path(path)
    if (path / "meta.json").exists() or not (path / "ckpt").is_dir():
        return path
    found, skipped = newest_good(path)
    if found is None:
        why = f"; newest: {skipped[0][0].name}: {skipped[0][1]}" if skipped else ""
        raise InputError(f"{path}: no checkpoint that verifies under {path / 'ckpt'}{why}")
    return found


def inspect(directory: str | Path) -> dict:
    """What a checkpoint holds: its meta, and each key's shape and dtype. The checkpoint must verify
    against its manifest; else InputError says what is wrong (and names the previous good one)."""
    directory = resolve(directory)
    read_meta(directory)
    _verified(directory)
    meta = read_meta(directory)
    md = read_dcp_metadata(directory)
    keys = {k: {"shape": list(getattr(v, "size", [])), "dtype": str(getattr(getattr(v, "properties", None), "dtype", ""))}
            for k, v in md.state_dict_metadata.items()}
    layers = sorted({int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k))})
    return {"meta": meta, "tensors": len(keys), "layers": layers, "keys": keys, "verified": True}


def _verified(directory: Path) -> None:
    try:
        verify(directory)
    except InputError as exc:
        run = directory.parent.parent if directory.parent.name == "ckpt" else None
        previous = newest_good(run)[0] if run is not None else None
        hint = f"; previous good checkpoint: {previous}" if previous is not None else ""
        raise InputError(f"{exc}{hint}") from None


def convert(src: str | Path, dst: str | Path) -> dict:
    """Join tensor-parallel shards into whole tensors: a universal checkpoint (single process).
    ``src`` must verify against its manifest (a run folder means its newest one that does); the
    result is written to a temporary folder with its own manifest and renamed to ``dst``."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    src = resolve(src)
    read_meta(src)
    _verified(src)
    read_dcp_metadata(src)
    meta = read_meta(src)
    dst = Path(dst)
    flat: dict = {}
    _load_state_dict(flat, storage_reader=safe_reader(src), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
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
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial")
    dcp.save(out, checkpoint_id=str(tmp), no_dist=True)
    new_meta = {**meta, "tp": 1, "converted_from": str(src)}
    (tmp / "meta.json").write_text(json.dumps(new_meta))
    if dst.exists():
        dst.rmdir()  # empty (the CLI refuses a non-empty destination)
    publish(tmp, dst, identity(new_meta))
    return {"tensors": len(out), "joined": len(groups), "source": str(src)}
