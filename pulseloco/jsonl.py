"""JSON-lines files: the records pulseloco writes beside a run (rounds, published versions, rollout batches).

One writer for every such file: :class:`JsonLinesWriter` appends one compact JSON object per line, from any
thread, and never interrupts training (a write that fails is logged). :func:`read_json_lines` reads a file back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

logger = logging.getLogger(__name__)

__all__ = ["JsonLinesWriter", "read_json_lines"]


class JsonLinesWriter:
    """Appends records to the JSON-lines file ``path`` (parent directories are created at construction).

    ``stamp``: start each record with ``time`` (seconds since the epoch, ms resolution) unless it has one.
    Writes are serialized by a lock, so threads never interleave lines. A write that fails (full disk,
    permissions) is logged as a warning and dropped; it never raises.
    """

    def __init__(self, path: str | os.PathLike[str], *, stamp: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stamp = stamp
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any] | DataclassInstance | None = None, /, **fields: Any) -> None:
        """Append one line: ``record`` (a mapping or a dataclass instance) updated with ``fields``."""
        if record is None or isinstance(record, Mapping):
            data = dict(record or {})
        else:
            data = dataclasses.asdict(record)
        data.update(fields)
        if self.stamp and "time" not in data:
            data = {"time": round(time.time(), 3), **data}
        line = json.dumps(data, separators=(",", ":"))
        try:
            with self._lock, self.path.open("a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        except OSError as exc:
            logger.warning("JSON-lines write failed path=%s error=%s", self.path, exc)


def read_json_lines(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file, in order (blank lines skipped). Raises :class:`OSError` when it cannot be
    read and :class:`json.JSONDecodeError` naming the position of a line that is not JSON."""
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
