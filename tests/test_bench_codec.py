"""experiments/codec/bench_codec.py: a smoke run end to end, and its baseline codecs on awkward shapes.

The benchmark's numbers are not asserted here (performance lives in the script's own output);
these tests check that it runs, reports every codec, and that its baselines are lossless.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import bench_codec as bench
import codec_timing
import pytest
import torch
from codec_baselines import BASELINES

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "codec" / "bench_codec.py"


@pytest.mark.timeout(120)
def test_small_run_reports_every_codec(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--lrs", "1e-5", "--threads", "1,2", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Targets" in proc.stdout

    report = json.loads(out.read_text())
    rows = report["rows"]
    inputs = {r["input"] for r in rows}
    # 1 lr x 2 windows (1 step, 8 steps) + 4 random densities.
    assert len(inputs) == 6
    assert {r["kind"] for r in rows} == {"real", "random"}
    for inp in inputs:
        assert {r["codec"] for r in rows if r["input"] == inp} == set(bench.CODECS)
    for r in rows:
        assert r["num_changed"] > 0
        assert r["patch_bytes"] > 0
        assert r["index_bytes"] is not None and 0 < r["index_bytes"] < r["patch_bytes"]
        assert r["clone_s"] > 0 and r["encode_s"] > 0 and r["apply_s"] > 0
        if r["codec"] in ("naive", "authors"):
            assert r["roundtrip_ok"], r
    names = {t["name"] for t in report["targets"]}
    assert any("authors bytes" in n for n in names)
    assert any("n*H(p)/8" in n for n in names)
    assert {"pulseloco-abs encode / clone at 1% random", "pulseloco-delta apply / clone at 10% random"} <= names
    # The random inputs were measured on 1 and 2 threads; the table holds the 2-thread rows.
    assert report["config"]["thread_counts"] == [1, 2]
    scaling = report["scaling"]
    assert {r["meta"]["threads"] for r in scaling} == {1, 2}
    assert len(scaling) == 2 * len([r for r in rows if r["kind"] == "random"])
    assert all(r["meta"]["threads"] == 2 for r in rows if r["kind"] == "random")
    assert "Thread scaling" in proc.stdout


def _edge_states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Shapes that exercise every width the baselines narrow to, and empty/full/corner changes."""
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "scalar": (),
        "vec": (70_000,),  # one row with more than 65536 columns: u32 column gaps
        "tall": (70_000, 2),  # row gaps above u16
        "wide": (3, 66_000),
        "conv": (4, 3, 5, 5),  # > 2-D views as dim 0 by the rest
        "untouched": (8, 8),
        "signed_zero": (2, 2),
        "all": (16, 300),  # every element: per-row counts above u8
    }
    base = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    new = {n: t.clone() for n, t in base.items()}

    def bump(name: str, flat_idx: list[int] | torch.Tensor) -> None:
        bits = new[name].view(torch.int16).view(-1)
        bits[torch.as_tensor(flat_idx)] += 1

    bump("scalar", [0])
    bump("vec", [0, 1, 65_999, 69_999])
    bump("tall", [0, 1, 139_999])  # row 0 cols 0-1, then row 69_999: a gap of 69_999 rows
    bump("wide", [5, 66_000 + 65_999, 2 * 66_000])
    bump("conv", torch.arange(0, 300, 7))
    bump("all", torch.arange(16 * 300))
    # -0.0 vs +0.0 is a change a float comparison would miss.
    base["signed_zero"][0, 1] = -0.0
    new["signed_zero"][0, 1] = 0.0
    return base, new


@pytest.mark.parametrize("codec", ["naive", "authors"])
def test_baselines_round_trip_edge_shapes(codec: str) -> None:
    base, new = _edge_states()
    baseline = BASELINES[codec]
    payload = baseline.encode(base, new)
    state = codec_timing.clone_state(base)
    num_changed = baseline.apply(state, payload)
    assert codec_timing.states_equal(state, new)
    expected = sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in base)
    assert num_changed == expected
    assert 0 < baseline.index_bytes(base, new) < len(payload)


def test_binary_entropy_bound() -> None:
    # About 1.01 bytes per changed element at p = 1% (docs/design.md section 6.2).
    p = 0.01
    assert codec_timing.binary_entropy(p) / p / 8 == pytest.approx(1.01, abs=0.005)
    assert codec_timing.binary_entropy(0.0) == 0.0
    assert codec_timing.binary_entropy(0.5) == pytest.approx(1.0)
