"""One shared thread pool for the codec, the digests and the scatter, sized by torch's intra-op thread count.

The heavy work of PULSESync and PULSELoCo payloads (comparing states, hashing them, gathering and scattering
values, entropy-coding indices) runs in numpy, zstd and xxhash loops that release the GIL, so threads scale
across cores. The pool follows :func:`torch.get_num_threads` (set it with ``torch.set_num_threads`` or
``OMP_NUM_THREADS``): with one thread every job runs inline in the caller, which is the reference the
multi-threaded results are tested against (the results never depend on the thread count: jobs return values
that the caller assembles in a fixed order).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

__all__ = ["num_threads", "parallel_map"]

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def num_threads() -> int:
    """The number of threads codec work uses: torch's intra-op thread count (at least 1)."""
    return max(1, torch.get_num_threads())


def _get_pool(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != size:
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="pulseloco-codec")
            _pool_size = size
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def parallel_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]``, run on :func:`num_threads` threads; results keep the order of ``items``.

    With one thread, or one item, everything runs inline. The first exception raised by ``fn`` propagates
    (after every submitted job has finished, so no job still touches the caller's buffers).
    """
    work = list(items)
    threads = num_threads()
    if threads == 1 or len(work) <= 1:
        return [fn(x) for x in work]
    if threading.current_thread().name.startswith("pulseloco-codec"):
        return [fn(x) for x in work]  # nested call from a pool job: run inline rather than deadlock the pool
    futures = [_get_pool(threads).submit(fn, x) for x in work]
    results: list[R] = []
    error: BaseException | None = None
    for future in futures:
        try:
            results.append(future.result())
        except BaseException as exc:  # wait for the rest before raising: they may write into shared arrays
            if error is None:
                error = exc
    if error is not None:
        raise error
    return results
