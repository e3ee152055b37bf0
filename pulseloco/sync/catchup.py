"""The catch-up paths of a PULSESync subscriber: the ways from the version it holds to the head, and fetching
their objects.

A subscriber one version behind takes the next patch; further behind, it first asks for one squashed patch (made
and signed by the publisher), then walks the patch chain back from the head. :func:`catch_up_paths` lists those
ways in the order they are tried, :func:`fetch_path` fetches one, and :func:`prefetch` fetches the first that
serves its objects, before :attr:`pulseloco.sync.subscriber.Subscriber.lock` is taken. Everything here only
fetches (every object authenticated by the :class:`~pulseloco.sync.sources.Source`); applying is the
subscriber's.

Failure behaviour: a path whose objects nobody serves gives None; :func:`fetch_path` logs a path that fails
(stale patch, digest mismatch, payload that does not authenticate) and gives None; anything else the source
raises propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pulseloco.errors import DigestMismatchError, PayloadError, StalePatchError
from pulseloco.sync.sources import Fetched, Head, Source
from pulseloco.sync.transport import FetchRequest

logger = logging.getLogger(__name__)

__all__ = ["CatchUpPath", "Prefetch", "catch_up_paths", "fetch_path", "prefetch", "walk_back"]

CatchUpPath = tuple[str, Callable[[], list[Fetched] | None]]
"""One way to the head: its name (``squash``, ``patch`` or ``chain``) and a function that fetches its objects."""


@dataclass(frozen=True)
class Prefetch:
    """Catch-up objects fetched before :attr:`~pulseloco.sync.subscriber.Subscriber.lock` was taken, to go from
    version ``base`` to ``head``: those of the catch-up path at ``index`` (see :func:`catch_up_paths`), the earlier
    paths having served nothing or failed (logged); ``index`` is past the last path, and ``objects`` empty, when
    all did."""

    base: int
    head: int
    index: int
    objects: list[Fetched]


def walk_back(source: Source, version: int, stop: int | None) -> list[Fetched] | None:
    """Patches from ``stop`` (exclusive) to ``version``, oldest first; None if the chain cannot be fetched (a
    patch nobody serves, a base before ``stop``, or more than 10,000 links). Raises what ``source`` raises."""
    chain: list[Fetched] = []
    v = version
    while v != stop:
        got = source.fetch(FetchRequest("patch", v))
        if got is None:
            return None
        chain.append(got)
        base = got.envelope.base_version
        if base is None or (stop is not None and base < stop) or len(chain) > 10_000:
            return None
        v = base
    return chain[::-1]


def catch_up_paths(source: Source, head: Head, current: int) -> list[CatchUpPath]:
    """The ways from ``current`` to ``head`` in the order they are tried, each a name and a function that
    fetches (and authenticates) its objects: a squash when more than one behind, then the next patch or the
    chain. A function returns None (or nothing) when no provider served the objects and raises what the
    source raises (:class:`PayloadError` for objects that do not authenticate)."""

    def by_squash() -> list[Fetched] | None:
        got = source.fetch(FetchRequest("squash", head.version, current))
        return None if got is None else [got]

    def by_chain() -> list[Fetched] | None:
        return walk_back(source, head.version, current)

    paths: list[CatchUpPath] = [("patch" if head.version - current == 1 else "chain", by_chain)]
    if head.version - current > 1:
        paths.insert(0, ("squash", by_squash))
    return paths


def fetch_path(name: str, get: Callable[[], list[Fetched] | None]) -> list[Fetched] | None:
    """The objects of one catch-up path; None when it served nothing or they failed (logged as a warning)."""
    try:
        return get() or None
    except (StalePatchError, DigestMismatchError, PayloadError) as exc:
        logger.warning("catch-up by %s failed error=%s; trying the next path", name, exc)
        return None


def prefetch(source: Source, head: Head, current: int) -> Prefetch:
    """The objects of the first catch-up path from ``current`` to ``head`` that serves them (the paths before
    it logged as failed); a :class:`Prefetch` with no objects when none did. Errors other than those of a failing
    path propagate."""
    paths = catch_up_paths(source, head, current)
    for index, (name, get) in enumerate(paths):
        objects = fetch_path(name, get)
        if objects:
            return Prefetch(current, head.version, index, objects)
    return Prefetch(current, head.version, len(paths), [])
