"""Which predictor fits a device: the shipped models and the ones users calibrated.

A predictor is valid only on the device it was measured on (its card's ``device``, for example
``cpu:AMD EPYC x1thr``). Models are looked for in the user's model directory (``$RESIHP_MODELS``,
default ``$XDG_DATA_HOME/resihp/models`` or ``~/.local/share/resihp/models``), where
``resihp predictor calibrate`` writes, then among the models shipped with resihp.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from resihp.errors import InputError
from resihp.paths import MODELS, resolve

CALIBRATE_HINT = "make one on this machine with `resihp predictor calibrate` (a few minutes)"


def user_models_dir() -> Path:
    if os.environ.get("RESIHP_MODELS"):
        return Path(os.environ["RESIHP_MODELS"])
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "resihp" / "models"


def search_dirs() -> list[Path]:
    return [user_models_dir(), MODELS]


def device_slug(device: str) -> str:
    """A directory name for a device: ``cpu:AMD EPYC x1thr`` -> ``cpu-amd-epyc-x1thr``."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


@dataclass(frozen=True)
class ModelEntry:
    path: Path
    device: str
    created: str


def installed_models() -> list[ModelEntry]:
    """Every readable predictor directory in the search directories, user models first."""
    out = []
    for root in search_dirs():
        for card_path in sorted(root.glob("*/card.json")) if root.is_dir() else []:
            try:
                card = json.loads(card_path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(card, dict) and isinstance(card.get("device"), str):
                out.append(
                    ModelEntry(card_path.parent, card["device"], str(card.get("created", "")))
                )
    return out


def find_for_device(device: str) -> Path | None:
    """The newest predictor measured on ``device``, user models before shipped ones."""
    return _newest([m for m in installed_models() if m.device == device])


def _newest(matches: list[ModelEntry]) -> Path | None:
    if not matches:
        return None
    return max(matches, key=lambda m: (m.path.parent != MODELS, m.created)).path


def resolve_model(spec: str | Path, device: str) -> Path:
    """A predictor directory from ``spec``.

    ``spec`` is ``auto`` (the model for ``device``), a path, or the name of an installed model. A
    model of another device is refused with what to do instead."""
    text = str(spec)
    if text == "auto":
        found = find_for_device(device)
        if found is None:
            have = sorted({f"{m.device} ({m.path})" for m in installed_models()})
            raise InputError(
                f"no micro-batch predictor for device {device!r} (installed: "
                f"{'; '.join(have) or 'none'}); {CALIBRATE_HINT}"
            )
        return found
    user = user_models_dir() / text
    if not Path(text).exists() and os.sep not in text and (user / "card.json").exists():
        return user
    try:
        path = resolve(text, "predictor")  # a path, or a shipped model by name
    except InputError:
        path = Path(text)
    if not (path / "card.json").exists():
        names = sorted({m.path.name for m in installed_models()})
        raise InputError(
            f"--predictor {text}: not a predictor directory and not an installed model "
            f"(installed: {', '.join(names) or 'none'}; or auto)"
        )
    return path


def check_device(path: Path, card_device: str, device: str) -> None:
    """Refuse to use a predictor on a device it was not measured on.

    Args:
        path: the predictor's directory, for the error.
        card_device: the device its card says it was measured on.
        device: the device the job runs on.
    """
    if card_device != device:
        raise InputError(
            f"{path}: measured on {card_device!r}, but this job runs on {device!r}; "
            f"use `--predictor auto` or {CALIBRATE_HINT}"
        )


def device_matches(measured: str, wanted: str) -> bool:
    """Whether a predictor measured on ``measured`` fits a cluster whose devices are ``wanted``.

    ``measured`` names a device as ``cuda:NVIDIA H100 80GB HBM3``; it fits with the same kind
    (``cuda``, ``cpu``) and, where ``wanted`` names a model (``cuda:NVIDIA H100``), that name within
    the measured one (case aside)."""
    kind, _, model = measured.partition(":")
    want_kind, _, want_model = wanted.partition(":")
    return (
        kind.strip().lower() == want_kind.strip().lower()
        and want_model.strip().lower() in model.lower()
    )


def find_matching(wanted: str) -> Path | None:
    """The newest predictor whose device :func:`device_matches` ``wanted``, user models first."""
    return _newest([m for m in installed_models() if device_matches(m.device, wanted)])


def card_device(path: Path) -> str:
    """The device a predictor directory's card says it was measured on."""
    try:
        card = json.loads((Path(path) / "card.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise InputError(f"{path}: no readable card.json (not a predictor directory)") from None
    device = card.get("device") if isinstance(card, dict) else None
    if not isinstance(device, str):
        raise InputError(
            f"{path / 'card.json'}: field device: expected the device it was measured "
            "on, e.g. 'cpu:AMD EPYC x1thr'"
        )
    return device
