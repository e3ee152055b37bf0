"""How the scripts report: tables, numbers, the run files they read, the comma lists they take, and plots.

- tables: :func:`md_table` (markdown), :func:`text_table` (columns as wide as their cells), :func:`fixed_table`
  (columns of set widths, labels left and numbers right, a blank line between groups), :func:`kv_lines`;
- numbers: :func:`fmt`, :func:`cell`, :func:`human`, :func:`mb`, :func:`mean`, :func:`percentile`;
- run files: :func:`read_records` (JSON lines) and :func:`read_json`, both tolerant of a file that is missing or
  was cut short by a killed process;
- arguments: :func:`parse_ints`, :func:`parse_floats`, :func:`comma_list` (``type=`` of argparse options) and
  :func:`parse_list` (with an example in its error);
- :func:`pyplot`: matplotlib without a display.

Formatting functions are pure and never raise for None (they print ``-``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from harness import REPO

T = TypeVar("T")
Column = tuple[str, int, Callable[[T], str]]
"""A column of :func:`fixed_table`: its name, its width, and the text of an item's cell."""


# ---- output folders ---------------------------------------------------------------------------------------------


def default_out(study: str, config: str) -> Path:
    """Where a run of ``experiments/STUDY`` given no ``--out`` writes: ``experiments/STUDY/results/CONFIG-STAMP``, a
    new folder named after the run's configuration and its start time (UTC, to the second), so that it never
    overwrites a results folder kept in the repository. Creates nothing."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return REPO / "experiments" / study / "results" / f"{config}-{stamp}"


def lr_label(lrs: Iterable[float | None]) -> str:
    """Learning rates for a folder name: ``3e-06,1e-05`` as ``3e-6_1e-5`` (``None``, the config's own: ``cfg``)."""
    return "_".join("cfg" if lr is None else f"{lr:g}".replace("e-0", "e-") for lr in lrs)


# ---- numbers ---------------------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".3f") -> str:
    """``format(value, spec)``; ``-`` for None."""
    return "-" if value is None else format(value, spec)


def cell(value: Any, digits: int = 2) -> str:
    """A table cell: ``-`` for None, a float with ``digits`` decimals, anything else as ``str``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def human(num_bytes: float) -> str:
    """Bytes in decimal units: ``512 B``, ``1.5 kB``, ``12.3 MB``, ``1.2 GB``."""
    for unit in ("B", "kB", "MB"):
        if abs(num_bytes) < 1000:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.1f} GB"


def mb(num_bytes: float | None) -> str:
    """Bytes as ``12.345 MB``; ``-`` for None."""
    return "-" if num_bytes is None else f"{num_bytes / 1e6:.3f} MB"


def mean(values: Iterable[Any]) -> float | None:
    """The mean of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) as the nearest value of the sorted ``values``; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ---- tables ----------------------------------------------------------------------------------------------------


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; cells through :func:`cell`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns as wide as their widest cell, two spaces apart, dashes under the header."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fixed_table(
    columns: Sequence[Column[T]], items: Iterable[T], *, left: int = 2, group: Callable[[T], Any] | None = None
) -> str:
    """Columns of the widths given, the first ``left`` aligned left (labels) and the rest right (numbers), a line of
    dashes under the header, and a blank line wherever ``group`` of an item differs from the previous item's."""

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, (_, w, _)) in enumerate(zip(cells, columns)))

    lines = [line([name for name, _, _ in columns])]
    lines.append("-" * len(lines[0]))
    prev = None
    for item in items:
        key = group(item) if group is not None else None
        if prev is not None and key != prev:
            lines.append("")
        prev = key
        lines.append(line([text(item) for _, _, text in columns]))
    return "\n".join(lines)


def kv_lines(rows: list[tuple[str, Any]]) -> str:
    """``key  value`` lines, the values aligned after the longest key."""
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


# ---- a run's files ---------------------------------------------------------------------------------------------


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; [] when it does not exist, blank lines and lines that are not JSON (one
    cut short by a killed process) skipped. Raises OSError only when it exists but cannot be read."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file; {} when it is missing, unreadable or not JSON."""
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return {}


# ---- arguments -------------------------------------------------------------------------------------------------


def parse_ints(text: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]`` (empty items skipped); raises ValueError, which argparse reports for a ``type=``."""
    return [int(x) for x in text.split(",") if x.strip()]


def parse_floats(text: str) -> list[float]:
    """``"1e-6,3e-6"`` -> ``[1e-06, 3e-06]`` (empty items skipped); raises ValueError like :func:`parse_ints`."""
    return [float(x) for x in text.split(",") if x.strip()]


def comma_list(text: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``."""
    return text.split(",")


def parse_list(ap: argparse.ArgumentParser, flag: str, text: str, kind: type, example: str) -> list[Any]:
    """The comma-separated values of option ``flag`` as ``kind``; exits through ``ap.error`` (with ``example``)
    when one does not parse or there are none."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        values = [kind(t) for t in items]
    except ValueError:
        ap.error(f"{flag}: {text!r} is not a comma-separated list of {kind.__name__}s, e.g. {example}")
    if not values:
        ap.error(f"{flag}: give at least one value, e.g. {example}")
    return values


# ---- plots -----------------------------------------------------------------------------------------------------


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display); raises ImportError without
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(
    out: Path, name: str, argv: list[str] | None, meta: dict[str, Any], rows: list[Any], table: str
) -> None:
    """Write a benchmark's rows as ``<out>/<name>.json`` (``{"meta", "rows"}``) and its table as ``<name>.md``,
    headed by the command (the script and ``argv``, default the process's arguments), the commit, the machine and
    the date, which are added to ``meta``. Creates ``out``; errors of the file system propagate."""
    import sys

    from harness.machine import git_revision, torch_note

    given = argv if argv is not None else sys.argv[1:]
    meta = {"command": " ".join([Path(sys.argv[0]).name, *given]), "commit": git_revision(),
            "machine": torch_note(), "date": time.strftime("%Y-%m-%d"), **meta}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    head = f"`{meta['command']}` at {meta['commit']} on {meta['machine']}, {meta['date']}"
    (out / f"{name}.md").write_text(f"{head}\n\n{table}\n")
