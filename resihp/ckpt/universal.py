"""Checkpoints keyed by global names, independent of the parallel layout.

Format 2 (what ``save`` writes): keys ``model.<global name>`` and
``optim.<global name>.<step|exp_avg|exp_avg_sq>``; every tensor-parallel shard is saved with its
place in the global tensor (``resihp.ckpt.reshard``: DTensor chunk metadata), so ``load`` reads it
into any data x pipeline x tensor-parallel layout, optimizer state included, with no convert step:
DCP reads each rank's block from whichever shards overlap it. Replicas of the same key on several
data-parallel ranks are written once. Beside the tensors, ``meta.json`` holds the step, the layout
that wrote it, the job id, the model hash and the non-tensor state (``resihp.ckpt.reshard_rules``
says how each key crosses a layout change); ``manifest.json`` (written last, see
:mod:`resihp.ckpt.integrity`) lists every file with its sha256. Nothing is read from a checkpoint
whose manifest does not verify, and DCP's pickled metadata only through a restricted unpickler.

Format 1 (older resihp: a shard saved as ``<key>@tp<rank>of<size>`` in the unsharded model's
shape) still loads into its own tensor-parallel size, and into any size once ``convert`` has
joined it; ``convert`` also exports any checkpoint as one consolidated file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from resihp.ckpt.integrity import (
    candidates,
    newest_good,
    publish,
    read_dcp_metadata,
    refusals,
    safe_reader,
    step_of,
    verify,
)
from resihp.ckpt.reshard import placed_state
from resihp.ckpt.single import single_process
from resihp.errors import InputError
from resihp.model.config import GPTConfig
from resihp.model.gpt import ADAM_KEYS, ensure_adam_state
from resihp.model.shards import split_of
from resihp.model.tensor_parallel import TPContext, full_shape, shard, unshard

FORMAT = 2


def _tp(tp: TPContext | int | None, tp_rank: int = 0) -> TPContext:
    if isinstance(tp, TPContext):
        return tp
    return TPContext(int(tp or 1), tp_rank)


def save(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    meta: dict,
    tp: TPContext | None = None,
    cfg: GPTConfig | None = None,
    extra: dict[str, torch.Tensor] | None = None,
    write: bool = True,
) -> None:
    """Collective: write a universal checkpoint of the job's state to ``directory``.

    Every rank of the job calls it. The tensors go to a hidden temporary folder; rank 0 (whose DCP
    call returns only after every rank's files are written) adds ``meta.json`` and the manifest,
    and renames the folder to ``directory``.

    Args:
        directory: the checkpoint folder to create.
        model: this rank's model (its stage and tensor-parallel shard).
        optimizer: its AdamW optimizer.
        step: the training step the state is after.
        meta: the job's fields written to ``meta.json`` beside ``step`` and ``format``.
        tp: this rank's tensor-parallel group (None: no tensor parallelism).
        cfg: the model's config (default: ``model.cfg``), which places each tensor globally.
        extra: this rank's own tensors (keys unique to the rank, such as its RNG state).
        write: whether this rank's model state is written (False on a hot spare, and on all but
            one replica when replicas differ in tensor-parallel size: their blocks would overlap).
    """
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.partial")
    state = placed_state(model, optimizer, tp, cfg) if write and model is not None else {}
    state.update(extra or {})
    dcp.save(state, checkpoint_id=str(tmp))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        meta = {"step": step, "format": FORMAT, **meta}
        (tmp / "meta.json").write_text(json.dumps(meta))
        publish(tmp, directory, identity(meta))


def identity(meta: dict) -> dict:
    """What the manifest records of the job that wrote a checkpoint."""
    return {k: meta.get(k) for k in ("job_id", "model_hash", "step")}


def load(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tp: TPContext | int | None = None,
    cfg: GPTConfig | None = None,
    extra: dict[str, torch.Tensor] | None = None,
    tp_rank: int = 0,
    reader=None,
) -> dict:
    """Fill this rank's parameters and AdamW state from ``directory``, whatever layout wrote it.

    ``directory`` must verify against its manifest; returns its meta. Collective when a process
    group is up (every rank calls it).

    Args:
        directory: the checkpoint folder.
        model: this rank's model, filled in place.
        optimizer: its AdamW optimizer, filled in place.
        tp: this rank's tensor-parallel group, or its size (None: 1).
        cfg: the model's config (default: ``model.cfg``).
        extra: this rank's own tensors, filled in place.
        tp_rank: this rank's tensor-parallel rank when ``tp`` is a size.
        reader: a DCP storage reader of ``directory`` in place of ``safe_reader``'s (one that
            counts bytes, say).
    """
    verify(directory)
    metadata = read_dcp_metadata(directory)  # refused here, with its reason, rather than inside DCP
    meta = read_meta(directory)
    tp = _tp(tp, tp_rank)
    if int(meta.get("format", 1)) < 2:
        return _load_v1(directory, meta, model, optimizer, tp)
    state = placed_state(model, optimizer, tp, cfg)
    _check_shapes(directory, state, metadata)
    state.update(extra or {})
    with refusals():
        dcp.load(state, storage_reader=reader or safe_reader(directory))
    return meta


def _check_shapes(directory: str | Path, state: dict[str, torch.Tensor], metadata) -> None:
    """One line naming the first key this model needs that the checkpoint lacks or holds in
    another global shape (DCP's own error is a multi-rank traceback)."""
    saved = metadata.state_dict_metadata
    for key, value in state.items():
        if key not in saved:
            raise InputError(
                f"{directory}: has no {key} (written for another model or model options)"
            )
        have = tuple(getattr(saved[key], "size", ()))
        if tuple(value.shape) != have:
            layout = (
                " (a format-1 checkpoint: `resihp ckpt convert` it)"
                if key.endswith("qkv.weight")
                else ""
            )
            raise InputError(
                f"{directory}: {key} has global shape {list(have)}, this model needs "
                f"{list(value.shape)}{layout}"
            )


def read_full(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint as its whole global tensor (one process, no process group)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    verify(directory)
    read_dcp_metadata(directory)
    flat: dict = {}
    with single_process(), refusals():
        _load_state_dict(
            flat,
            storage_reader=safe_reader(directory),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    return flat


# --- format 1 -------------------------------------------------------------------------------------
def _v1_key(name: str, tp: TPContext) -> str:
    return f"{name}@tp{tp.rank}of{tp.size}" if tp.size > 1 and split_of(name) else name


def _load_v1(
    directory: str | Path,
    meta: dict,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tp: TPContext,
) -> dict:
    """Format 1: shards in the unsharded model's shape; into the tensor-parallel size that wrote
    them, or slices of whole tensors (a tp=1 or converted checkpoint) into any size."""
    saved_tp = int(meta.get("tp", 1))
    if saved_tp not in (1, tp.size):
        raise InputError(
            f"{directory}: an older resihp checkpoint (format 1) written with tp={saved_tp}; "
            f"run `resihp ckpt convert` on it before loading it with tp={tp.size}"
        )
    ensure_adam_state(model, optimizer)
    live = {}
    for name, p in model.named_parameters():
        key = _v1_key(name, TPContext(saved_tp, tp.rank))
        live[f"model.{key}"] = p.detach()
        for k in ADAM_KEYS:
            live[f"optim.{key}.{k}"] = optimizer.state[p][k]
    if saved_tp == tp.size:
        with refusals():
            dcp.load(live, storage_reader=safe_reader(directory))
        return meta
    wanted = {
        k: torch.empty(full_shape(_param_name(k), v.shape, tp.size) if v.dim() else ())
        for k, v in live.items()
    }
    with refusals():
        dcp.load(wanted, storage_reader=safe_reader(directory))
    with torch.no_grad():
        for k, v in wanted.items():
            live[k].copy_(
                v if live[k].shape == v.shape else shard(_param_name(k), v, tp.size, tp.rank)
            )
    return meta


def _param_name(key: str) -> str:
    """``model.X`` / ``optim.X.exp_avg`` -> ``X``."""
    name = re.sub(r"^(model|optim)\.", "", key)
    return re.sub(r"\.(step|exp_avg|exp_avg_sq)$", "", name) if key.startswith("optim.") else name


def read_meta(directory: str | Path) -> dict:
    """A checkpoint's ``meta.json``: a JSON object whose ``step`` is the last step it trained."""
    path = Path(directory) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"{directory}: not a resihp checkpoint (no meta.json)") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise InputError(f"{path}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InputError(
            f"{path}: field step: expected the last step the checkpoint trained (a whole "
            f"number >= 0), got {step!r}"
        )
    return meta


def resolve(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names.

    A checkpoint folder is itself; a run folder or a folder of checkpoints (``--ckpt-dir``) means
    the newest checkpoint in it that verifies."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    root = path / "ckpt" if (path / "ckpt").is_dir() else path
    if not candidates(root):
        return path
    found, skipped = newest_good(root)
    if found is None:
        why = f"; newest: {skipped[0][0].name}: {skipped[0][1]}" if skipped else ""
        raise InputError(f"{path}: no checkpoint that verifies under {root}{why}")
    return found


def inspect(directory: str | Path) -> dict:
    """What a checkpoint holds: its meta, and each key's shape and dtype.

    The checkpoint must verify against its manifest; else InputError says what is wrong (and names
    the previous good one)."""
    directory = resolve(directory)
    read_meta(directory)
    _verified(directory)
    meta = read_meta(directory)
    md = read_dcp_metadata(directory)
    keys = {
        k: {
            "shape": list(getattr(v, "size", [])),
            "dtype": str(getattr(getattr(v, "properties", None), "dtype", "")),
        }
        for k, v in md.state_dict_metadata.items()
    }
    layers = sorted(
        {int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    )
    return {"meta": meta, "tensors": len(keys), "layers": layers, "keys": keys, "verified": True}


def _verified(directory: Path) -> None:
    try:
        verify(directory)
    except InputError as exc:
        previous = newest_good(directory.parent)[0] if step_of(directory) >= 0 else None
        hint = f"; previous good checkpoint: {previous}" if previous is not None else ""
        raise InputError(f"{exc}{hint}") from None


def convert(src: str | Path, dst: str | Path) -> dict:
    """Every tensor of a checkpoint as one whole tensor in the unsharded model's shape.

    Single process. ``dst`` ending in ``.pt`` or ``.safetensors``: one consolidated file for use
    outside resihp (torch.save / safetensors); else a checkpoint folder (format 1, tp 1: what any
    layout of any resihp version loads), written to a temporary folder with its own manifest and
    renamed. ``src`` must verify against its manifest (a run folder means its newest one that
    does)."""
    src = resolve(src)
    read_meta(src)
    _verified(src)
    read_dcp_metadata(src)
    meta = read_meta(src)
    dst = Path(dst)
    flat = read_full(src)
    groups: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, value in flat.items():
        m = re.match(r"^(.*)@tp(\d+)of(\d+)(\..*)?$", key)
        if m:  # format 1: join the shards
            groups.setdefault(m.group(1) + (m.group(4) or ""), {})[int(m.group(2))] = value
        elif (
            key.startswith(("model.", "optim."))
            and split_of(_param_name(key))
            and value.dim() > 1
            and split_of(_param_name(key))[1] > 1
            and int(meta.get("format", 1)) >= 2
        ):
            out[key] = value.reshape(
                -1, *value.shape[2:]
            )  # fused (groups, rows, ...) -> the model's shape
        else:
            out[key] = value
    for key, pieces in groups.items():
        ordered = [pieces[i] for i in sorted(pieces)]
        out[key] = ordered[0] if key.endswith(".step") else unshard(_param_name(key), ordered)
    dst.parent.mkdir(parents=True, exist_ok=True)
    result = {"tensors": len(out), "joined": len(groups), "source": str(src)}
    if dst.suffix in (".pt", ".safetensors"):
        model = {
            k.removeprefix("model."): v.contiguous()
            for k, v in out.items()
            if k.startswith("model.")
        }
        if dst.suffix == ".pt":
            torch.save({"model": model, "meta": meta}, dst)
        else:
            try:  # deferred: only this export needs safetensors
                from safetensors.torch import save_file
            except ImportError:
                raise InputError(
                    f"{dst}: writing .safetensors needs the safetensors package "
                    f"(pip install safetensors), or name a .pt file"
                ) from None
            save_file(model, str(dst), metadata={"resihp": json.dumps(meta)})
        return {**result, "tensors": len(model), "file": str(dst)}
    tmp = dst.with_name(f".{dst.name}.partial")
    with single_process():
        dcp.save(out, checkpoint_id=str(tmp), no_dist=True)
    new_meta = {
        **{k: v for k, v in meta.items() if k != "format"},
        "tp": 1,
        "format": 1,
        "converted_from": str(src),
    }
    (tmp / "meta.json").write_text(json.dumps(new_meta))
    if dst.exists():
        dst.rmdir()  # empty (the CLI refuses a non-empty destination)
    publish(tmp, dst, identity(new_meta))
    return result
