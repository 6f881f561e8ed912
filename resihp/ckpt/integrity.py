"""Checkpoint integrity: manifests, their check, and a safe reader of DCP's metadata.

A manifest of every file (size and sha256) written last and atomically, a check of it before any
byte of a checkpoint is trusted, and a reader of torch.distributed.checkpoint's pickled
``.metadata`` that admits only DCP's own metadata types (a crafted pickle cannot run code).

A checkpoint is written into a hidden temporary folder beside its final name; the manifest is
written last, every file and the folder are fsynced, and one ``rename`` makes it visible. A folder
named ``stepN`` without a manifest, or whose files do not match it, is never loaded."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path

from resihp.errors import InputError
from resihp.paths import write_text_atomic

MANIFEST = "manifest.json"
FORMAT = "resihp-ckpt-manifest/1"
CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_json_atomic(path: Path, data: object) -> None:
    """``path`` holds either its old content or all of ``data``, never a part (temp, fsync,
    rename)."""
    write_text_atomic(path, json.dumps(data, indent=1, allow_nan=False))


def write_manifest(directory: str | Path, identity: dict | None = None) -> dict:
    """List every file of ``directory`` with its size and sha256 in ``manifest.json``.

    The manifest is written last, fsynced and renamed into place; ``identity`` (job id, model hash)
    is recorded beside the files."""
    directory = Path(directory)
    files = {}
    for path in _files(directory):
        _fsync_path(path)
        files[path.relative_to(directory).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": _sha256(path),
        }
    manifest = {"format": FORMAT, **(identity or {}), "files": files}
    write_json_atomic(directory / MANIFEST, manifest)
    _fsync_path(directory)
    return manifest


def read_manifest(directory: str | Path) -> dict | None:
    try:
        data = json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def problem(directory: str | Path) -> str | None:
    """What is wrong with checkpoint ``directory`` (one phrase), or None when nothing is.

    Nothing is when every file it lists is there with its size and sha256 and the DCP metadata and
    resihp meta are among them."""
    directory = Path(directory)
    if not directory.is_dir():
        return "not a folder"
    if not (directory / MANIFEST).exists():
        return "no manifest.json (an incomplete checkpoint, or one written before manifests)"
    manifest = read_manifest(directory)
    if manifest is None:
        return "manifest.json is not a valid manifest"
    files = manifest["files"]
    for required in (".metadata", "meta.json"):
        if required not in files:
            return f"the manifest lists no {required}"
    for name, entry in sorted(files.items()):
        path = directory / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            return f"the manifest names a file outside the checkpoint: {name!r}"
        if not path.is_file():
            return f"{name} is missing"
        try:
            size, digest = int(entry["size"]), str(entry["sha256"])
        except (KeyError, TypeError, ValueError):
            return f"the manifest entry of {name} has no size and sha256"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
        if _sha256(path) != digest:
            return f"{name} does not match its sha256 in the manifest (corrupted)"
    unlisted = [
        p.relative_to(directory).as_posix()
        for p in _files(directory)
        if p.relative_to(directory).as_posix() not in files
    ]
    if any(name.endswith((".distcp", ".metadata")) for name in unlisted):
        return f"{unlisted[0]} is not in the manifest"
    try:
        metadata = read_dcp_metadata(directory)
    except InputError as exc:
        return str(exc).split(": ", 1)[-1]
    # the manifest lists what was in this folder when it was written; the DCP metadata names every
    # rank's shard file: one written elsewhere (another node's own folder) leaves the state torn
    named = {
        str(getattr(info, "relative_path", "")) for info in (metadata.storage_data or {}).values()
    }
    missing = sorted(name for name in named if name and name not in files)
    if missing:
        return (
            f"{missing[0]} is missing: the DCP metadata names it (its rank wrote it elsewhere; "
            "a job on several nodes needs one --ckpt-dir every node writes to)"
        )
    return None


def verify(directory: str | Path) -> dict:
    """The manifest of a checkpoint that verifies; else InputError naming what is wrong."""
    why = problem(directory)
    if why is not None:
        raise InputError(f"{directory}: damaged checkpoint: {why}")
    return read_manifest(directory)  # type: ignore[return-value]


def publish(tmp: Path, final: Path, identity: dict | None = None) -> None:
    """Write the manifest of the complete checkpoint in ``tmp`` and rename it to ``final``.

    An older checkpoint of that name (e.g. of an earlier job in the same folder) is replaced whole.

    Args:
        tmp: the hidden temporary folder holding the complete checkpoint.
        final: the checkpoint's name.
        identity: what the manifest records of the job that wrote it (job id, model hash, step).
    """
    write_manifest(tmp, identity)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- DCP metadata through a restricted unpickler --------------------------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata classes, torch dtypes and sizes, and paths.

    Anything else (such as ``os.system`` or ``builtins.eval``) is refused before it can be
    called."""

    def find_class(self, module: str, name: str) -> object:
        import torch

        if module in _DCP_MODULES and not name.startswith("__"):
            import importlib

            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def read_dcp_metadata(directory: str | Path, tensors_only: bool = True):
    """DCP's ``Metadata`` of a checkpoint, read through :class:`MetadataUnpickler`."""
    path = Path(directory) / ".metadata"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{directory}: cannot read checkpoint metadata ({exc.strerror})") from None
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise InputError(f"{path}: not DCP checkpoint metadata ({exc})") from None
    except Exception as exc:  # a truncated or foreign pickle raises many types
        raise InputError(f"{path}: not DCP checkpoint metadata ({type(exc).__name__})") from None
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    if not isinstance(metadata, Metadata):
        raise InputError(f"{path}: not DCP checkpoint metadata (a {type(metadata).__name__})")
    _check_items(path, metadata, tensors_only)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _check_items(path: Path, metadata, tensors_only: bool = True) -> None:
    """Every item DCP would read is a file inside the checkpoint, stored untransformed, and (with
    ``tensors_only``) a tensor.

    resihp writes only tensors with DCP (non-tensor state goes to ``meta.json``); DCP loads a
    non-tensor (bytes) item with an unrestricted ``torch.load``, so a checkpoint naming one is
    refused before any of its bytes are read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, entry in (metadata.state_dict_metadata or {}).items():
        if tensors_only and not isinstance(entry, TensorStorageMetadata):
            raise InputError(
                f"{path}: item {key!r}: expected a tensor, got a pickled "
                f"{type(entry).__name__} (resihp checkpoints hold tensors only)"
            )
    for index, info in (metadata.storage_data or {}).items():
        name = Path(str(getattr(info, "relative_path", "")))
        if not name.parts or name.is_absolute() or ".." in name.parts:
            raise InputError(
                f"{path}: item {getattr(index, 'fqn', index)!r}: storage file "
                f"{str(name)!r}: expected a file name inside the checkpoint"
            )
        if getattr(info, "transform_descriptors", None):
            raise InputError(
                f"{path}: item {getattr(index, 'fqn', index)!r}: expected untransformed "
                f"storage, got transforms {list(info.transform_descriptors)}"
            )


def safe_reader(directory: str | Path, tensors_only: bool = True):
    """A ``FileSystemReader`` whose metadata comes through the restricted unpickler.

    It reads tensors only (each through DCP's ``torch.load(weights_only=True)``); with
    ``tensors_only`` False, bytes items too, which ``safe_planner``'s planner must then unpickle."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_dcp_metadata(directory, tensors_only)
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            # DCP unpickles a bytes item with torch.load(weights_only=False): never let one through
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO and (
                    tensors_only or not getattr(planner, "weights_only", False)
                ):
                    raise InputError(
                        f"{directory}: item {item.dest_index.fqn!r}: expected a tensor, "
                        "got a pickled object (resihp checkpoints hold tensors only)"
                    )
            return super().read_data(plan, planner)

    return SafeReader(str(directory))


def safe_planner(directory: str | Path):
    """A DCP load planner that unpickles bytes items with ``torch.load(weights_only=True)``.

    A bytes item is an int, a list, a dict of plain values (a data loader's position, say); never
    arbitrary code."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        weights_only = True

        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else "refused"
                raise InputError(
                    f"{directory}: item {fqn!r}: expected plain values (numbers, "
                    f"strings, lists, dicts, tensors), got a pickled object the "
                    f"weights-only loader refuses ({first})"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafePlanner()


@contextlib.contextmanager
def refusals():
    """Re-raise a refusal (InputError) from inside a DCP load, on any rank, as itself.

    Rather than DCP's multi-rank traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for error, _ in exc.failures.values():
            if isinstance(error, InputError):
                raise InputError(str(error)) from None
        raise


# --- choosing a checkpoint ------------------------------------------------------------------------

STEP_DIR = re.compile(r"^step(\d+)$")


def step_of(path: Path) -> int:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def candidates(root: str | Path) -> list[Path]:
    """The ``stepN`` folders under the checkpoint folder ``root`` (``OUT/ckpt``), newest first."""
    folder = Path(root)
    found = (
        [p for p in folder.glob("step*") if STEP_DIR.match(p.name) and p.is_dir()]
        if folder.is_dir()
        else []
    )
    return sorted(found, key=step_of, reverse=True)


def newest_good(
    root: str | Path, job_id: str | None = None, model_hash: str | None = None
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``root`` that verifies, and each newer one skipped with its
    reason.

    Args:
        root: the checkpoint folder.
        job_id: only a checkpoint written by this job counts (None: any job's).
        model_hash: only a checkpoint of the model with this hash counts (None: any model's).
    """
    skipped: list[tuple[Path, str]] = []
    for path in candidates(root):
        why = problem(path)
        if why is None:
            manifest = read_manifest(path) or {}
            if job_id is not None and manifest.get("job_id") != job_id:
                why = f"written by another job ({manifest.get('job_id') or 'unknown'})"
            elif model_hash is not None and manifest.get("model_hash") != model_hash:
                why = "written for another model configuration"
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def remove_partial(root: str | Path) -> None:
    """Hidden temporary checkpoint folders under ``root`` left by a job that died while writing
    one."""
    for tmp in Path(root).glob(".step*"):
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)


def prune(root: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` checkpoints under ``root`` (0: keep all)."""
    if keep <= 0:
        return []
    old = candidates(root)[keep:]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old
