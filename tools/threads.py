"""Work in threads: the default thread count, an ordered map with a progress bar, and imports in the background
(started by tools.options for the model libraries, finished by tools.errors.optional_module and model building),
and a run's data work beside its model building (`alongside`)."""

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


def alongside(data: Callable[[], object], model: Callable[[], object],
              imports: Sequence[str] = ()) -> tuple[object, object]:
    """(data(), model()): `data` in a background thread started first, `model` in this one meanwhile, so a run's
    data work (listing, hashing, decoding) overlaps its model building. Both have finished when this returns or
    raises: no thread outlives the call. A data error wins over a model error (the input is at fault first), so a
    damaged file is still one `error:` line whatever the model did.

    `imports`: the modules `data` imports on its way (torchvision.io for decoding), imported here first, with the
    background imports finished: two threads importing torch's modules at once see each other's half-made modules
    (seen: loading a torch.export program failed with KeyError 'torch._dynamo' while torchvision was imported)."""
    wait_for_background_imports()
    for name in imports:
        importlib.import_module(name)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="data")
    try:
        future = pool.submit(data)
        try:
            built = model()
        except BaseException:
            future.exception()  # wait for the data work; its error, if any, replaces the model's
            if future.exception() is not None:
                raise future.exception() from None
            raise
        return future.result(), built
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
