"""The replay's detector thread and its observer thread share the making of a window's chunks
(``resihp.replay.detectors._Chunks``): every chunk once, in order, an error where it is reached,
nothing made far beyond a stop."""

import threading
import time

import pytest

from resihp.replay.detectors import AHEAD, _Chunks


def test_every_chunk_is_made_once_and_comes_in_order_from_both_threads():
    made: list[tuple[int, str]] = []
    lock = threading.Lock()

    def make(key: int) -> int:
        with lock:
            made.append((key, threading.current_thread().name))
        time.sleep(0.002 * (key % 3))  # uneven chunks: both threads take some
        return key * key

    keys = list(range(0, 120, 4))
    assert list(_Chunks(make, keys)) == [k * k for k in keys]
    assert sorted(k for k, _ in made) == keys  # each once, by whichever thread took it


def test_an_error_is_raised_where_its_chunk_is_reached():
    def make(key: int) -> int:
        if key == 3:
            raise ValueError("chunk 3")
        return key

    got = []
    with pytest.raises(ValueError, match="chunk 3"):
        for v in _Chunks(make, list(range(8))):
            got.append(v)
    assert got == [0, 1, 2]


def test_a_stop_takes_no_more_chunks():
    made = []

    def make(key: int) -> int:
        made.append(key)
        time.sleep(0.001)
        return key

    chunks = _Chunks(make, list(range(100)))
    for v in chunks:
        if v == 10:
            break
    chunks.stop()
    chunks.observer.join(timeout=5)
    assert not chunks.observer.is_alive()
    assert max(made) <= 10 + AHEAD
