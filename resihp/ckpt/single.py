"""DCP in one process (``no_dist``): reads and writes without a process group.

DCP warns on every
such call, even one that asks for it, in words a user of ``resihp ckpt convert`` or a keeper's log
cannot act on; this keeps that one warning out."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """Inside it, DCP's "torch.distributed is ... uninitialized" warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            category=UserWarning,
            message=r"torch\.distributed is (disabled, )?unavailable or uninitialized",
        )
        yield
