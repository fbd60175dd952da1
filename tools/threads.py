"""Work in threads: the default thread count, an ordered map with a progress bar, imports in the background, and
a run's data work beside its model building (`alongside`)."""

from __future__ import annotations

import concurrent.futures
import contextvars
import importlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence

from tools.progress import progress_bar


def default_workers() -> int:
    """Threads for decoding, hashing and checking files: one per CPU, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


class ContextThreadPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose tasks run with a copy of the submitting thread's context variables (so
    tools.errors.spoken_as holds in the workers too)."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)


def map_in_threads(fn: Callable, items: Sequence, workers: int, progress: bool, desc: str) -> Iterator:
    """fn over items in `workers` threads, results in order, with a progress bar; on an error or an interrupt,
    work not yet started is cancelled."""
    pool = ContextThreadPool(max_workers=max(1, workers), thread_name_prefix="work")
    try:
        yield from progress_bar(pool.map(fn, items), total=len(items), desc=desc, disable=not progress, leave=False)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_background: list[threading.Thread] = []
_forgetting = threading.Lock()


def import_in_background(names: Sequence[str]) -> None:
    """Import modules in a background thread, in order, stopping at the first failure (it fails again, with its
    message, where needed). Call wait_for_background_imports before importing any of them in another thread."""
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
    """Every import_in_background finished: two threads importing modules that import each other see half-made
    modules (a false ImportError), so model building waits rather than racing them."""
    for thread in list(_background):
        if thread is not threading.current_thread():
            thread.join()
            with _forgetting:  # the data thread and the main thread may both have waited for it
                if thread in _background:
                    _background.remove(thread)


_stop = threading.Event()  # set while an interrupted `alongside` waits for its data work to give up


class Stopped(Exception):
    """Background data work given up at a `stop_point`: the run was interrupted (Ctrl-C, SIGTERM)."""


def stop_point() -> None:
    """Where data work gives up, per file, once the run is interrupted (signals reach only the main thread)."""
    if _stop.is_set():
        raise Stopped("interrupted")


def alongside(data: Callable[[], object], model: Callable[[], object],
              imports: Sequence[str] = ()) -> tuple[object, object]:
    """(data(), model()): `data` in a background thread, `model` in this one meanwhile; no thread outlives the
    call. A data error wins over a model error (the input is at fault first); an interrupt wins over both.
    `imports`: the modules `data` imports on its way, imported here first (two threads importing torch's modules
    at once see half-made ones: loading a torch.export program failed with KeyError 'torch._dynamo')."""
    wait_for_background_imports()
    for name in imports:
        importlib.import_module(name)
    pool = ContextThreadPool(max_workers=1, thread_name_prefix="data")
    future = pool.submit(data)
    try:
        try:
            built = model()
        except Exception:
            error = future.exception()  # wait for the data work; its error, if any, replaces the model's
            if error is not None:
                raise error from None
            raise
        return future.result(), built
    except BaseException as exc:
        if not isinstance(exc, Exception) and not future.done():
            _stop.set()  # interrupted: the data work stops at its next file
            future.add_done_callback(lambda _: _stop.clear())  # even if a second interrupt cuts the wait short
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _stop.clear()
