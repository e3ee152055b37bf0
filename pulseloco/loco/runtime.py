"""A private asyncio event loop in a daemon thread, for hivemind's P2P calls from synchronous training code.

hivemind's P2P objects live in one event loop; the training loop is synchronous. :class:`BackgroundLoop`
owns a loop in a thread and runs coroutines on it with a timeout, so that no remote wait can block the
training thread forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from pulseloco.errors import SwarmError

logger = logging.getLogger(__name__)

__all__ = ["BackgroundLoop"]

T = TypeVar("T")


class BackgroundLoop:
    """An event loop running in a daemon thread until :meth:`shutdown`."""

    def __init__(self, name: str = "pulseloco-loco") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait at most ``timeout`` seconds for its result.

        On timeout the coroutine is cancelled and :class:`SwarmError` is raised; exceptions of the coroutine
        propagate unchanged.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise SwarmError(f"swarm operation did not finish within {timeout:.1f}s") from None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop and join its thread (at most ``timeout`` seconds)."""
        if not self.loop.is_running():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(timeout=timeout)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            logger.warning("background loop tasks did not stop cleanly error=%r", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)
