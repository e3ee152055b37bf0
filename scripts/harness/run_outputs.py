"""What a recipe run leaves in its output directory, read back: the model's parameter count from its safetensors
headers, the sizes in a PULSESync version store, and the bytes a ring all-reduce would have sent instead.

``experiments/compare/compare.py`` (every strategy's workers) and ``scripts/demo_report.py`` (the demo's peers) read the
same files; the JSON files themselves go through :func:`harness.report.read_json` and
:func:`harness.report.read_records`, which tolerate a file that is missing or was cut short. Nothing here raises for a
missing directory or file: each function says what it returns instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def allreduce_bytes(num_params: int, num_workers: int) -> float:
    """FP32 bytes one worker sends in a ring all-reduce of ``num_params`` values among ``num_workers``:
    ``2 (W - 1) / W * 4 * num_params`` (0 for one worker; ``ZeroDivisionError`` for none)."""
    return 2 * (num_workers - 1) / num_workers * 4 * num_params


def count_parameters(model_dir: Path) -> int | None:
    """Parameters of the Hugging Face model saved in ``model_dir``: the tensors of its ``*.safetensors`` files (tied
    weights are stored once, as ``model.parameters()`` counts them), read from their headers without torch. ``None``
    when there are no such files or one cannot be read."""
    total, files = 0, sorted(model_dir.glob("*.safetensors"))
    for path in files:
        try:
            with path.open("rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
        except (OSError, ValueError):
            return None
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total if files else None


def store_summary(store: Path) -> dict[str, Any]:
    """Sizes of a publisher's version store (payload plus signed envelope per object), by version:
    ``{"anchors": {version: bytes}, "patches": {version: bytes}}``, both empty when ``store`` is not a directory."""
    sizes: dict[str, dict[int, int]] = {"anchor": {}, "patch": {}}
    if store.is_dir():
        for env in sorted(store.glob("v*.*.env")):
            payload = env.with_suffix("")
            kind = payload.suffix.lstrip(".")
            if kind in sizes and payload.exists():
                version = int(payload.stem.lstrip("v"))
                sizes[kind][version] = payload.stat().st_size + env.stat().st_size
    return {"anchors": sizes["anchor"], "patches": sizes["patch"]}
