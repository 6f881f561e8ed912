"""Checked decoding of what a job reads from its torch.distributed store.

The store has no authentication: whoever reaches its port can write any key. Every record read
from it is parsed here into its checked form; a malformed, truncated, oversized or foreign record
is warned about once per key, in one line, and dropped (the reader acts as if it were absent).
Records that carry authority (plan changes, the job's launch and end announcements, orders to
stop, relaunch or evict, the replicas' membership) carry an HMAC-SHA256 under the job's secret
(``JOB_SECRET_ENV``): an unsigned or wrongly signed one is refused the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

log = logging.getLogger("resihp.store")

T = TypeVar("T")
MAX_RECORD_BYTES = 16 << 20  # no control-plane record comes near this (an op record: ~100 kB)


class RecordError(ValueError):
    """A record read from the store is not of its expected form (one line)."""


def fields(
    doc: Any,
    what: str,
    spec: Mapping[str, type | tuple[type, ...]],
    optional: Mapping[str, type | tuple[type, ...]] | None = None,
) -> dict:
    """``doc`` as a JSON object with each field of ``spec`` present and of its type.

    Args:
        doc: the decoded JSON value.
        what: the record's kind, for the message.
        spec: required field name -> accepted type(s).
        optional: fields that may be absent or null, else of their type(s).
    """
    if not isinstance(doc, dict):
        raise RecordError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    for name, kind in spec.items():
        if name not in doc:
            raise RecordError(f"{what}: field {name!r} missing")
        _check(doc[name], kind, what, name)
    for name, kind in (optional or {}).items():
        if doc.get(name) is not None:
            _check(doc[name], kind, what, name)
    return doc


def _check(value: Any, kind: type | tuple[type, ...], what: str, name: str) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # JSON has no int/bool distinction worth trusting: a bool is not a count or a PID
    if isinstance(value, bool) and bool not in kinds:
        raise RecordError(f"{what}: field {name!r} expected {_names(kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise RecordError(
            f"{what}: field {name!r} expected {_names(kinds)}, got {type(value).__name__}"
        )


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def load_json(raw: bytes | str) -> Any:
    """The JSON value in ``raw``, or RecordError (too large, not UTF-8, not JSON)."""
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"{len(raw)} bytes, more than the {MAX_RECORD_BYTES} a record may hold")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise RecordError(f"not JSON ({' '.join(str(exc).split())[:120]})") from None


class StoreRecords:
    """A reader's decoder of store records, warning once per key about a dropped one.

    ``decode(key, raw, parse)`` returns the parsed record or None; ``dropped`` counts every record
    dropped."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self.log = logger
        self.warned: set[str] = set()
        self.dropped = 0
        self._lock = threading.Lock()

    def decode(self, key: str, raw: bytes | str | None, parse: Callable[[Any], T]) -> T | None:
        """``parse(json value of raw)``, or None where ``raw`` is None or not of its form.

        Args:
            key: the store key the record was read from, for the warning.
            raw: the record as stored (None: absent).
            parse: turns the JSON value into the record, raising where it is not of its form.
        """
        if raw is None:
            return None
        try:
            return parse(load_json(raw))
        except (RecordError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            self.reject(key, exc)
            return None

    def reject(self, key: str, why: object) -> None:
        """Drop the record at ``key``: a one-line warning, the first time for this key."""
        with self._lock:
            self.dropped += 1
            if key in self.warned:
                return
            self.warned.add(key)
        self.log.warning("store key %s: record dropped: %s", key, " ".join(str(why).split())[:300])


RECORDS = StoreRecords()  # the process's decoder: each key warned about once per process


def checked_int(raw: bytes | str | None, key: str, records: StoreRecords = RECORDS) -> int | None:
    """An integer record (a step, an attempt, a count), or None where absent or malformed.

    Args:
        raw: the record as stored (None: absent).
        key: the store key it was read from, for the warning.
        records: the decoder (default: the process's).
    """
    return records.decode(key, raw, _int)


def _int(doc: Any) -> int:
    if isinstance(doc, bool) or not isinstance(doc, int):
        raise RecordError(f"expected an integer, got {type(doc).__name__}")
    return doc


# --- authority: records that steer the job are signed with the job's secret -------------------
JOB_SECRET_ENV = "RESIHP_JOB_SECRET"  # the job's secret (hex), handed to its processes
SIGNATURE = "sig"


def _digest(doc: Mapping[str, Any], secret: str) -> str:
    body = json.dumps(
        {k: v for k, v in doc.items() if k != SIGNATURE}, sort_keys=True, separators=(",", ":")
    )
    return hmac.new(secret.encode(), body.encode(), hashlib.sha256).hexdigest()


def sign(doc: Mapping[str, Any], secret: str) -> dict:
    """``doc`` with its HMAC-SHA256 under ``secret`` (``SIGNATURE``)."""
    return {**doc, SIGNATURE: _digest(doc, secret)}


def verified(doc: Any, secret: str | None, what: str) -> dict:
    """``doc`` without its signature, or RecordError where it is unsigned or wrongly signed.

    Args:
        doc: the record read.
        secret: the job's secret (None: nothing signed is taken).
        what: what the error names as the record.
    """
    doc = fields(doc, what, {})
    if not isinstance(doc.get(SIGNATURE), str):
        raise RecordError(f"{what}: refused: not signed with the job's secret")
    if secret is None or not hmac.compare_digest(doc[SIGNATURE], _digest(doc, secret)):
        raise RecordError(f"{what}: refused: its signature is not the job's")
    return {k: v for k, v in doc.items() if k != SIGNATURE}


def job_secret() -> str:
    """This job's secret, which signs the records that steer it.

    ``RESIHP_JOB_SECRET`` where set (every node of a job is launched with the same), else one made
    now, at random, and kept in this process's environment for the processes it starts."""
    if not os.environ.get(JOB_SECRET_ENV):
        os.environ[JOB_SECRET_ENV] = secrets.token_hex(32)
    return os.environ[JOB_SECRET_ENV]


def signed_json(doc: Mapping[str, Any], secret: str | None = None) -> str:
    """``doc`` signed with ``secret`` (by default the job's, ``job_secret``), as stored."""
    return json.dumps(sign(doc, secret or job_secret()), separators=(",", ":"))


def authority(
    what: str,
    spec: Mapping[str, type | tuple[type, ...]],
    optional: Mapping[str, type | tuple[type, ...]] | None = None,
    secret: str | None = None,
    verify: bool = True,
    same: Mapping[str, Any] | None = None,
) -> Callable[[Any], dict]:
    """A parser for ``StoreRecords.decode`` of a signed record: its signature, then its fields.

    Args:
        what: what errors name as the record.
        spec: its required fields and their types.
        optional: its optional fields and their types.
        secret: the secret its signature is checked under (default: this process's
            ``RESIHP_JOB_SECRET``; without one nothing signed is taken).
        verify: False for a reader that acts on nothing (a follower): the record is taken without
            checking its signature.
        same: fields that must hold these values (the key's replica or node, so a signed record
            copied to another key is refused).
    """

    def parse(doc: Any) -> dict:
        if verify:
            doc = verified(doc, secret or os.environ.get(JOB_SECRET_ENV) or None, what)
        else:
            doc = {k: v for k, v in fields(doc, what, {}).items() if k != SIGNATURE}
        doc = fields(doc, what, spec, optional)
        for name, value in (same or {}).items():
            if doc.get(name) != value:
                raise RecordError(
                    f"{what}: refused: field {name!r} is {doc.get(name)!r}, not {value!r} "
                    "(a record of another key)"
                )
        return doc

    return parse
