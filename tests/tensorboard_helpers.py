"""Reading back what a Trainer's ``report_to: tensorboard`` wrote, with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the one run whose event files are under ``directory`` (searched recursively):
    tag -> [(step, value)] in the order written. Values come back as TensorBoard stores them (float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(directory.rglob("events.out.tfevents.*"))
    runs = {path.parent for path in files}
    assert len(runs) == 1, f"expected one run's event files under {directory}, found {files}"
    accumulator = EventAccumulator(str(runs.pop()), size_guidance={"scalars": 0})  # 0: keep every value
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }
