"""The PULSESync version store: a directory of signed anchors and patches, written atomically.

Layout of a store directory::

    v00000001.anchor        full BF16 state (safetensors bytes)
    v00000001.anchor.env    its signed envelope: the READY marker, written last
    v00000002.patch         patch from the previous published version (pulseloco frame)
    v00000002.patch.env

Every file is written under a temporary name, flushed, fsynced and renamed, and an object counts only once its
``.env`` exists, so a crash mid-write leaves either the old store or the new one, never a half object
(leftover temporaries are removed when the store is opened). Retention keeps the newest ``keep_anchors``
anchors and every patch a kept version depends on (those after the oldest kept anchor).

The store holds bytes and envelopes; it does not verify signatures (readers do, with the publisher's key).
"""

from __future__ import annotations

import builtins
import logging
import os
import re
from pathlib import Path
from typing import Literal, get_args

from pulseloco.errors import ConfigError, PayloadError

logger = logging.getLogger(__name__)

__all__ = ["KINDS", "VersionStore"]

StoredKind = Literal["anchor", "patch"]
KINDS: tuple[StoredKind, ...] = get_args(StoredKind)
_NAME = re.compile(r"^v(\d{8})\.(anchor|patch)\.env$")


class VersionStore:
    """A directory of versions. Not safe for two writers; any number of readers is fine.

    Raises :class:`ConfigError` if ``path`` is not a usable directory.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True) -> None:
        self.path = Path(path)
        if create:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"cannot create store directory {self.path}: {exc.strerror}") from None
        if not self.path.is_dir():
            raise ConfigError(f"store directory {self.path} does not exist (check --store)")
        if create:
            for leftover in self.path.glob("*.tmp"):
                logger.info("removing leftover temporary file=%s", leftover.name)
                leftover.unlink(missing_ok=True)

    def _file(self, kind: str, version: int) -> Path:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return self.path / f"v{version:08d}.{kind}"

    def object_path(self, kind: str, version: int) -> Path:
        """The payload file of an object (its envelope is the same name plus ``.env``), for messages and
        rollbacks; the file need not exist. Raises :class:`ValueError` for an unknown ``kind``."""
        return self._file(kind, version)

    def _atomic_write(self, target: Path, data: bytes) -> None:
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def write(self, kind: str, version: int, payload: bytes, envelope: bytes) -> None:
        """Store an object: the payload first, then its envelope (the READY marker), each atomically.

        On an OSError (disk full, permissions) the object is not READY and the error propagates.
        """
        path = self._file(kind, version)
        self._atomic_write(path, payload)
        self._atomic_write(path.with_name(path.name + ".env"), envelope)
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def has(self, kind: str, version: int) -> bool:
        """Whether a READY object exists."""
        path = self._file(kind, version)
        return path.with_name(path.name + ".env").exists() and path.exists()

    def read(self, kind: str, version: int) -> tuple[bytes, bytes]:
        """``(envelope, payload)`` of a READY object. Raises :class:`FileNotFoundError` if absent."""
        path = self._file(kind, version)
        if not self.has(kind, version):
            raise FileNotFoundError(f"{kind} for version {version} is not in store {self.path}")
        return path.with_name(path.name + ".env").read_bytes(), path.read_bytes()

    def read_envelope(self, kind: str, version: int) -> bytes:
        """The envelope of a READY object. Raises :class:`FileNotFoundError` if absent."""
        path = self._file(kind, version)
        return path.with_name(path.name + ".env").read_bytes()

    # ``builtins.list``: inside the class body ``list`` names the method below, not the type
    def list(self, kind: str) -> builtins.list[int]:
        """Sorted versions of READY objects of ``kind``."""
        out = []
        for entry in os.scandir(self.path):
            m = _NAME.match(entry.name)
            if m and m.group(2) == kind and self._file(kind, int(m.group(1))).exists():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> int | None:
        """The newest READY version (anchor or patch), or None for an empty store."""
        versions = self.list("anchor") + self.list("patch")
        return max(versions) if versions else None

    def chain_to(self, version: int) -> tuple[int, builtins.list[int]]:
        """The newest anchor at or below ``version`` and the patch versions that lead from it to ``version``.

        Raises :class:`PayloadError` if there is no such anchor or the chain has a gap.
        """
        anchors = [a for a in self.list("anchor") if a <= version]
        if not anchors:
            raise PayloadError(f"store {self.path} has no anchor at or below version {version}")
        anchor = anchors[-1]
        patches = [p for p in self.list("patch") if anchor < p <= version]
        if version != anchor and (not patches or patches[-1] != version):
            raise PayloadError(f"store {self.path} has no patch for version {version}")
        return anchor, patches

    def prune(self, keep_anchors: int) -> builtins.list[Path]:
        """Delete anchors older than the newest ``keep_anchors`` and patches at or before the oldest kept anchor.

        Envelopes are removed first, so a reader never sees a READY object without its payload.
        """
        if keep_anchors < 1:
            raise ConfigError(f"keep_anchors must be at least 1, got {keep_anchors}")
        anchors = self.list("anchor")
        if len(anchors) <= keep_anchors:
            return []
        oldest_kept = anchors[-keep_anchors]
        doomed = [("anchor", a) for a in anchors if a < oldest_kept]
        doomed += [("patch", p) for p in self.list("patch") if p <= oldest_kept]
        removed = []
        for kind, version in doomed:
            path = self._file(kind, version)
            for p in (path.with_name(path.name + ".env"), path):
                p.unlink(missing_ok=True)
                removed.append(p)
        logger.info("pruned store=%s objects=%d oldest_anchor=%d", self.path, len(doomed), oldest_kept)
        return removed
