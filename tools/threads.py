"""Work in threads: the default thread count, and an ordered map with a progress bar."""

from __future__ import annotations

import concurrent.futures
import os
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
