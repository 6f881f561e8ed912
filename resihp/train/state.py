"""The user's training state as flat tensors and a JSON tree: what a snapshot holds.

Any object with ``state_dict()`` and ``load_state_dict()`` (torch's ``Stateful``: a module, an
optimizer, an LR scheduler, a stateful data loader) or a plain dict of such values can be held.
Tensors go to the memory tier's slot by key; everything else (ints, floats, strings, lists,
tuples, dicts with int or str keys) is kept as JSON beside it, tagged so that tuples stay tuples
and int keys stay ints (an optimizer's state is keyed by parameter index).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from resihp.errors import InputError

TENSOR, TUPLE, LIST, DICT, FLOAT = "__tensor__", "__tuple__", "__list__", "__dict__", "__float__"


def state_dict_of(value: Any) -> Any:
    """The value's state: ``state_dict()`` of a Stateful, else the value itself."""
    return value.state_dict() if hasattr(value, "state_dict") else value


def flatten(state: Mapping[str, Any]) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """Every tensor of ``state`` by key, and the JSON tree that places them.

    ``state`` maps names to Statefuls or plain values; a value of another type is a one-line
    ``InputError`` naming its path."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value  # this rank's shard
            tensors.append((path, local.detach()))
            return {TENSOR: path}
        if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {FLOAT: repr(value)}
        if isinstance(value, tuple):
            return {TUPLE: [walk(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return {LIST: [walk(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            items = []
            for k, v in value.items():
                if not isinstance(k, (int, str)) or isinstance(k, bool):
                    raise InputError(
                        f"training state {path!r}: key {k!r} is a "
                        f"{type(k).__name__}; expected str or int keys"
                    )
                items.append([k, walk(v, f"{path}.{k}")])
            return {DICT: items}
        raise InputError(
            f"training state {path!r}: a {type(value).__name__} cannot be snapshot; "
            "expected tensors, numbers, strings, lists, tuples or dicts"
        )

    tree = {name: walk(state_dict_of(value), name) for name, value in state.items()}
    return tensors, tree


def unflatten(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The state ``flatten`` took apart, with ``tensors`` (by key) in their places."""
    if isinstance(tree, dict):
        if TENSOR in tree:
            return tensors[tree[TENSOR]]
        if FLOAT in tree:
            return float(tree[FLOAT])
        if TUPLE in tree:
            return tuple(unflatten(v, tensors) for v in tree[TUPLE])
        if LIST in tree:
            return [unflatten(v, tensors) for v in tree[LIST]]
        if DICT in tree:
            return {k: unflatten(v, tensors) for k, v in tree[DICT]}
        return {k: unflatten(v, tensors) for k, v in tree.items()}
    return tree


def like(template: Any, saved: torch.Tensor) -> torch.Tensor:
    """``saved`` (a local shard) in the form of ``template``: a DTensor on its mesh, on its
    device."""
    if isinstance(template, DTensor):
        return DTensor.from_local(
            saved.to(template.to_local().device),
            template.device_mesh,
            template.placements,
            run_check=False,
        )
    return saved.to(template.device) if isinstance(template, torch.Tensor) else saved


class RNG:
    """The random generators a training loop draws from, as a Stateful.

    Torch's (CPU and, where present, every CUDA device's), Python's ``random`` and NumPy's
    global generator."""

    def state_dict(self) -> dict:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        numpy = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos)}
        numpy.update(has_gauss=int(has_gauss), gauss=float(gauss))
        state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"].cpu().clone())  # its own storage: a view crashes it
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if "numpy" in state:  # absent in snapshots taken before NumPy's generator was held
            n = state["numpy"]
            keys = n["keys"].cpu().numpy().astype(np.uint32)
            np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["gauss"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu().clone() for s in state["cuda"]])
