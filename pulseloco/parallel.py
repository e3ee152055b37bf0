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


def parallel_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    cost: Callable[[T], float] | None = None,
    inline_below: float = 0.0,
) -> list[R]:
    """``[fn(x) for x in items]``, run on :func:`num_threads` threads; results keep the order of ``items``.

    ``cost``: an estimate of each job's work. Jobs are then started largest first, so that a large job does not
    start last and run alone. Jobs that cost less than ``inline_below`` run in the calling thread while the pool
    works on the others. Small numpy calls hold the GIL for most of their time, and threads fighting over it
    are slower than one thread. With one thread, or one item, everything runs inline. The first exception
    raised by ``fn`` propagates, after every submitted job has finished, so that no job still touches the
    caller's buffers.
    """
    work = list(items)
    threads = num_threads()
    if threads == 1 or len(work) <= 1:
        return [fn(x) for x in work]
    if threading.current_thread().name.startswith("pulseloco-codec"):
        return [fn(x) for x in work]  # nested call from a pool job: run inline rather than deadlock the pool
    costs = [0.0] * len(work) if cost is None else [cost(x) for x in work]
    order = sorted(range(len(work)), key=lambda i: -costs[i])
    pooled = [i for i in order if cost is None or costs[i] >= inline_below]
    pool = _get_pool(threads)
    futures = {i: pool.submit(fn, work[i]) for i in pooled}
    results: dict[int, R] = {}
    error: BaseException | None = None
    for i in order:
        if i in futures:
            continue
        try:
            results[i] = fn(work[i])
        except BaseException as exc:  # finish the pooled jobs before raising: they may write into shared arrays
            error = exc
            break
    for i, future in futures.items():
        try:
            results[i] = future.result()
        except BaseException as exc:
            if error is None:
                error = exc
    if error is not None:
        raise error
    return [results[i] for i in range(len(work))]
