"""The outlier screen of PULSELoCo contributions (pulseloco.loco.validation)."""

from __future__ import annotations

from pulseloco.loco.validation import screen_outliers


def test_outlier_screen_uses_the_median_of_three_and_the_own_part_below() -> None:
    assert set(screen_outliers({"a": 1.0, "b": 1.2, "c": 50.0}, 10.0)) == {"c"}
    assert screen_outliers({"a": 1.0, "c": 50.0}, 10.0) == {}  # two and no reference: no majority, no verdict
    assert set(screen_outliers({"me": 1.0, "c": 50.0}, 10.0, reference=1.0)) == {"c"}
    assert screen_outliers({"me": 1.0, "c": 5.0}, 10.0, reference=1.0) == {}
    assert screen_outliers({"me": 0.0, "c": 5.0}, 10.0, reference=0.0) == {}  # nothing of its own: no bar
