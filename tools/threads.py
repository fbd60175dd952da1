"""Work in threads: the default thread count, an ordered map with a progress bar, and imports in the background
(started by tools.options for the model libraries, finished by tools.errors.optional_module and model building)."""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import threading
from typing import Callable, Iterator, Sequence

from tqdm import tqdm


def default_workers() -> int:
    """Threads for decoding, hashing and checking files: one per CPU, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def map_in_threads(fn: Callable, items: Sequence, workers: int, progress: bool, desc: str) -> Iterator:
    """fn over items in `workers` threads, results in order, with a progress bar.

    Pillow, NumPy's file reading, hashlib and OpenCV release the GIL, so threads decode, hash and segment
    in parallel. On an error or an interrupt, work not yet started is cancelled.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="work")
    try:
        yield from tqdm(pool.map(fn, items), total=len(items), desc=desc, disable=not progress, leave=False)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_background: list[threading.Thread] = []


def import_in_background(names: Sequence[str]) -> None:
    """Import modules in a background thread, in order, stopping at the first failure (an import that fails
    here fails again, with its proper message, where it is needed). Call wait_for_background_imports before
    importing any of them, or anything that imports them, in another thread."""
    def work() -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 (reported where the module is needed)
                return

    thread = threading.Thread(target=work, name="import", daemon=True)
    _background.append(thread)
    thread.start()


def wait_for_background_imports() -> None:
    """Every import_in_background finished. Two threads importing modules that import each other would see
    each other's half-initialised modules (Python's per-module import locks break the deadlock that way, with
    a false ImportError), so model building waits for the background imports rather than racing them."""
    for thread in list(_background):
        if thread is not threading.current_thread():
            thread.join()
            if thread in _background:
                _background.remove(thread)
