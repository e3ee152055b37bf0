"""experiments/compare/compare.py: a minimal comparison end to end (GRPO from the tiny warm model, two strategies, one
outer round, on 127.0.0.1), its aggregation over seeds and its verdicts on hand-made runs (the frontier table, the
targets, the plots of every strategy, wire bytes sent and received per round and in payloads), ``--report`` over
several compare.json, the command lines of 16 workers, and the one-line refusals (bad flags; a Python that is not
the project's; compare.json files run with other settings).

Timings are not asserted (they live in compare.md); the end-to-end test checks that both strategies ran with two
workers whose rounds were averaged by both peers, that compare.md, compare.json and the plots were written, that
peer 0 published PULSESync versions, and that the bytes are ordered as the algorithms say at an RL learning rate:
PULSELoCo (the pulse rule) sends less than DiLoCo (every entry, every round).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import compare  # experiments/compare/compare.py (on the tests' path: pyproject.toml)
import compare_report
import compare_results
import compare_runs
import pytest
from harness.netns import NetNS
from harness.procs import Runner

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "compare" / "compare.py"
TINY_CONFIG = REPO / "recipes" / "configs" / "grpo-tiny.yaml"
"""The tiny model's config (2 prompts a step): the default, grpo-demo.yaml, is for the demo warm model."""
SYSTEM_PYTHON = Path("/usr/bin/python3")
HAS_DEPS = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('transformers', 'trl')))"
"""Exits 0 where the Python can import the project's main dependencies (found, not imported: fast)."""


DEFAULT_STRATEGIES = [
    "diloco", "pulseloco", "pulseloco-bf16", "sparseloco", "sparseloco-k128", "pulseloco-2bit", "pulseloco-2bit-k64",
]  # fmt: skip
"""compare.py's default strategies: every one but ddp."""


def run_compare(argv: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run compare.py; on a timeout SIGTERM it first, so that it stops the processes it started."""
    kwargs.setdefault("cwd", REPO)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)  # type: ignore[call-overload]
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"compare.py still running after {timeout:.0f} s:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@pytest.mark.timeout(200)
def test_minimal_grpo_comparison_writes_table_json_and_plots(tmp_path: Path, tiny_warm_model: Path) -> None:
    out = tmp_path / "results"
    runs = tmp_path / "runs"
    # --parallel: both strategies at once (times are not compared here); 8 steps are one outer round (inner_steps 8)
    argv = [sys.executable, str(SCRIPT), "--strategies", "diloco,pulseloco", "--workers", "2", "--steps", "8"]
    argv += ["--lrs", "1e-6", "--seeds", "1", "--parallel", "--out", str(out), "--runs-dir", str(runs)]
    argv += ["--model_name_or_path", str(tiny_warm_model), "--config", str(TINY_CONFIG), "--timeout", "150"]
    argv += ["--", "--num_eval_prompts", "16"]
    proc = run_compare(argv, timeout=190)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    md = (out / "compare.md").read_text()
    assert "## lr 1e-06, 1 seed, greedy reward before training" in md
    assert "| diloco |" in md and "| pulseloco |" in md
    assert "ran concurrently" in md and "loopback" in md
    assert "pulseloco targets: bytes vs DiLoCo" in md and "not judged" in md  # one seed: no quality claim
    assert "| held-out sampled reward: before -> after |" in md
    assert re.search(r"\| diloco \| [0-9.]+ \| (yes|no) \| [0-9.]+ -> [0-9.]+ ± [0-9.]+ \|", md), md
    for png in ("compare_reward_bytes.png", "compare_reward_time.png", "compare_final.png", "compare_density.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = json.loads((out / "compare.json").read_text())
    results = {r["strategy"]: r for r in report["results"]}
    assert set(results) == {"diloco", "pulseloco"}
    for name, r in results.items():
        assert r["error"] is None and r["workers"] == 2 and r["lr"] == 1e-6
        assert r["group_sizes"] == [2], name  # the round was averaged by both peers
        assert r["steps"] == 8 and r["rounds"] == 1 and len(r["density"]) == 1
        assert r["final_source"] == "greedy" and 0 <= r["final"] <= 1 and 0 <= r["reward_before"] <= 1
        # the held-out sampled reward of both peers' grpo_eval.json (the recipe's default 8 draws per prompt)
        assert 0 <= r["sampled_before"] <= 1 and 0 <= r["sampled_after"] <= 1 and 0 <= r["sampled_se_after"] < 0.2
        assert r["bytes_per_worker"] > 0
        assert len(r["curve"]) == 1  # the sampled reward at step 8 (logging_steps 8)
        sync = r["pulsesync"]  # peer 0 published the starting model (an anchor) and the round's version (a patch)
        assert sync["anchors"] == 1 and sync["patches"] == 1 and 0 < sync["mean_patch_bytes"] < sync["bf16_copy_bytes"]
    assert results["diloco"]["density"] == [1.0]
    assert 0 < results["pulseloco"]["density"][0] < 0.5  # an RL learning rate: most updates invisible in BF16
    for name, r in results.items():  # wire and payload bytes, and the split of the wire bytes: identities only
        t = r["traffic"]  # traffic_summary of both peers' rounds (one each)
        assert t["rounds"] == 2 and t["num_sent"] > 0, name
        parts = t["sent_index_bytes"] + t["sent_value_bytes"] + t["sent_sum_bytes"] + t["sent_header_bytes"]
        assert parts == t["bytes_sent"] == pytest.approx(2 * r["bytes_per_worker"]), name
        assert t["sent_sum_bytes"] == t["sent_sum_index_bytes"] + t["sent_sum_value_bytes"], name
        assert t["payload_bytes"] == pytest.approx(2 * r["payload_bytes_per_worker"]), name
        assert 0 < t["payload_index_bytes"] + t["payload_value_bytes"] < t["payload_bytes"], name  # + frame header
        assert r["wire_bytes_per_round"] == pytest.approx(r["bytes_per_worker"]), name  # one round
        assert t["bytes_received"] == pytest.approx(2 * r["bytes_received_per_worker"]), name
        assert t["bytes_received"] > 0, name
        assert r["received_bytes_per_round"] == pytest.approx(r["bytes_received_per_worker"]), name
        assert r["payload_bytes_per_round"] == pytest.approx(r["payload_bytes_per_worker"]), name
        assert r["entries_per_round"] == t["num_sent"] / 2, name
        e = r["bytes_per_entry"]
        assert e["wire_bytes"] == pytest.approx(t["bytes_sent"] / t["num_sent"]), name
        split = e["index_bytes"] + e["value_bytes"] + e["sum_bytes"] + e["header_bytes"]
        assert split == pytest.approx(e["wire_bytes"]), name
        assert e["payload_bytes"] == pytest.approx(t["payload_bytes"] / t["num_sent"]), name
        assert e["index_bits_bound"] == pytest.approx(t["index_bound_bits_per_entry"]), name
    dense = results["diloco"]["traffic"]  # every entry: no index bytes anywhere, a bound of 0 bits
    assert dense["payload_index_bytes"] == dense["sent_index_bytes"] == dense["sent_sum_index_bytes"] == 0
    assert results["diloco"]["bytes_per_entry"]["index_bits_bound"] == pytest.approx(0, abs=1e-6)
    assert results["pulseloco"]["bytes_per_entry"]["index_bits_bound"] > 0
    rows = {r["strategy"]: r for r in report["rows"]}
    assert rows["diloco"]["vs_diloco"] == 1.0 and 0 < rows["pulseloco"]["vs_diloco"] < 1
    assert rows["diloco"]["payload_vs_diloco"] == 1.0 and rows["pulseloco"]["payload_vs_diloco"] > 0
    assert rows["pulseloco"]["bytes_per_entry"] == pytest.approx(results["pulseloco"]["bytes_per_entry"])  # 1 seed
    for name, row in rows.items():  # in payloads: wire bytes per round over payload bytes per round
        wire, received, payload = (row[k] for k in ("wire_bytes_per_round", "received_bytes_per_round",
                                                     "payload_bytes_per_round"))  # fmt: skip
        assert row["payloads_sent_per_round"] == pytest.approx(wire / payload), name
        assert row["payloads_received_per_round"] == pytest.approx(received / payload), name
        assert min(wire, received, payload) > 0, name
    assert "| strategy | wire B sent / worker / round | wire B received / worker / round | sent vs DiLoCo |" in md
    assert "index bits/entry: pushed / payload / bound |" in md
    assert (runs / "keys" / "publisher").stat().st_mode & 0o077 == 0  # the signing key: private to its owner

    again = tmp_path / "again"  # --report: the same table from the JSON, no runs, then where the runs came from
    proc = run_compare([sys.executable, str(SCRIPT), "--report", str(out / "compare.json"), "--out", str(again)], 60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table, sources = (again / "compare.md").read_text().split("\n\n## Reported from\n")
    assert table + "\n" == md and (again / "compare_density.png").exists() and (again / "frontier.png").exists()
    assert f"`{out / 'compare.json'}`: commit " in sources and "runs kept: diloco x1, pulseloco x1" in sources


def fake_run(strategy: str, seed_index: int, final: float, sent: float, lr: float = 1e-5) -> dict[str, Any]:
    """One run's summary as summarize() makes it (the fields aggregate() reads)."""
    return {
        "strategy": strategy, "lr": lr, "seed": 1000 * seed_index, "seed_index": seed_index, "limited": True,
        "error": None, "final": final, "reward_before": 0.2, "bytes_per_worker": sent, "bytes_measured": True,
        "train_seconds": 10.0, "wall_seconds": 30.0, "density": [0.1, 0.05], "incomplete_rounds": 0,
        "pulsesync": {"mean_patch_bytes": 40.0, "bf16_copy_bytes": 2000},
    }  # fmt: skip


def test_aggregate_judges_quality_by_diloco_range_over_seeds() -> None:
    runs = [fake_run("diloco", j, final, 1700.0) for j, final in enumerate((0.30, 0.40, 0.35))]
    runs += [fake_run("pulseloco", j, final, 100.0) for j, final in enumerate((0.33, 0.37, 0.38))]
    runs += [fake_run("sparseloco", j, final, 300.0) for j, final in enumerate((0.19, 0.45, 0.45))]
    runs.append({**fake_run("pulseloco", 3, 0.9, 1.0), "error": "peer1 exited with 1"})  # failed: not counted
    rows = {r["strategy"]: r for r in compare_results.aggregate(runs)}
    pulse, diloco, sparse = rows["pulseloco"], rows["diloco"], rows["sparseloco"]
    assert pulse["seeds"] == 3 and pulse["final_mean"] == pytest.approx(0.36)
    assert (pulse["final_min"], pulse["final_max"]) == (0.33, 0.38)
    assert pulse["final_std"] == pytest.approx(0.02645751, rel=1e-6)
    assert pulse["vs_diloco"] == pytest.approx(1 / 17) and pulse["vs_ddp"] is None
    assert pulse["improved"] and pulse["within_diloco_range"] and pulse["patch_vs_bf16"] == pytest.approx(0.02)
    assert not sparse["improved"]  # one seed fell below the warm model's 0.2
    assert "did not learn" in compare_report.quality_verdict(sparse, diloco)
    assert "within DiLoCo's range [0.300, 0.400] over 3 seeds" in compare_report.quality_verdict(pulse, diloco)
    assert compare_report.verdict(pulse["vs_diloco"], compare_report.TARGETS["diloco"]) == "1/17 (met)"
    assert compare_report.sampled_cell(pulse) == "-"  # these runs wrote no sampled reward (as older results)
    seeded = [{**fake_run("diloco", j, 0.4, 1.0), "sampled_before": 0.3, "sampled_after": a, "sampled_se_after": 0.01}
              for j, a in enumerate((0.36, 0.34))]  # fmt: skip
    row = compare_results.aggregate(seeded)[0]
    assert row["sampled_after"] == [0.36, 0.34] and compare_report.sampled_cell(row) == "0.300 -> 0.350 [0.340, 0.360]"
    assert compare_report.sampled_cell(compare_results.aggregate(seeded[:1])[0]) == "0.300 -> 0.360 ± 0.010"
    assert compare_report.verdict(0.1, compare_report.TARGETS["diloco"]) == "1/10 (missed by 1.7x)"
    one_seed = {r["strategy"]: r for r in compare_results.aggregate(runs[:1] + runs[3:4])}
    assert "at least 2 seeds" in compare_report.quality_verdict(one_seed["pulseloco"], one_seed["diloco"])


def sampled_run(strategy: str, seed_index: int, after: float) -> dict[str, Any]:
    """A run whose greedy reward stayed at the warm model's 0.2 and whose held-out sampled reward went from 0.30
    (± 0.01) to ``after`` (± 0.01): a gain is learned beyond 2 x sqrt(0.01^2 + 0.01^2) = 0.0283."""
    return {**fake_run(strategy, seed_index, 0.2, 100.0), "sampled_before": 0.30, "sampled_after": after,
            "sampled_se_before": 0.01, "sampled_se_after": 0.01}  # fmt: skip


def test_aggregate_judges_learning_and_quality_by_the_sampled_reward_where_every_run_has_it() -> None:
    runs = [sampled_run("diloco", j, a) for j, a in enumerate((0.36, 0.34, 0.35))]  # gains .06 .04 .05: learned
    runs += [sampled_run("pulseloco", j, a) for j, a in enumerate((0.345, 0.35, 0.33))]  # .03 > .0283: learned
    runs += [sampled_run("sparseloco", j, a) for j, a in enumerate((0.325, 0.36, 0.40))]  # .025 < .0283 once: not
    rows = {r["strategy"]: r for r in compare_results.aggregate(runs)}
    pulse, diloco, sparse = rows["pulseloco"], rows["diloco"], rows["sparseloco"]
    assert {r["learned_by"] for r in rows.values()} == {"sampled"}
    assert pulse["sampled_gain_se"] == pytest.approx([0.01 * math.sqrt(2)] * 3)
    assert pulse["sampled_gain"] == pytest.approx([0.045, 0.05, 0.03])
    assert diloco["improved"] and pulse["improved"] and not sparse["improved"]  # the greedy reward never moved
    assert not pulse["greedy_improved"] and pulse["within_diloco_range"]  # 0.3417 in [0.34, 0.36]
    summary = (pulse["sampled_mean"], diloco["sampled_min"], diloco["sampled_max"])
    assert summary == pytest.approx((0.3417, 0.34, 0.36), abs=1e-4)
    assert compare_report.quality_verdict(pulse, diloco) == (
        "mean of the held-out sampled reward 0.342 within DiLoCo's range [0.340, 0.360] over 3 seeds"
    )
    assert "sparseloco did not learn (every seed's held-out sampled gain beyond 2 standard errors)" in (
        compare_report.quality_verdict(sparse, diloco)
    )
    # one strategy at this learning rate without the sampled reward (--num_eval_samples 0): all judged greedily
    greedy = {r["strategy"]: r for r in compare_results.aggregate([*runs, fake_run("ddp", 0, 0.3, 1.0)])}
    assert {r["learned_by"] for r in greedy.values()} == {"greedy"}
    assert not greedy["pulseloco"]["improved"] and greedy["ddp"]["improved"]
    assert "mean gain >= 0.05" in compare_report.quality_verdict(greedy["pulseloco"], greedy["diloco"])


def test_aggregate_reports_wire_and_payload_bytes_per_round_and_per_entry() -> None:
    split = {"wire_bytes": 9.0, "index_bytes": 1.0, "value_bytes": 3.0, "sum_bytes": 4.5, "header_bytes": 0.5,
             "payload_bytes": 5.0, "index_bits_pushed": 8.0, "index_bits_payload": 7.0, "index_bits_bound": 6.0,
             "sum_bytes_per_union_entry": 4.0}  # fmt: skip
    swarm = {"steps": 16, "rounds": 2}  # 8 optimizer steps a round
    runs = [
        {**fake_run("ddp", 0, 0.3, 16000.0), **swarm, "rounds": 0, "bytes_measured": False,
         "payload_bytes_per_worker": 32000.0},
        {**fake_run("diloco", 0, 0.3, 1600.0), **swarm, "payload_bytes_per_worker": 820.0,
         "wire_bytes_per_round": 800.0, "payload_bytes_per_round": 410.0, "entries_per_round": 100.0,
         "bytes_per_entry": {**split, "index_bytes": 0.0, "index_bits_bound": 0.0}},
        *({**fake_run("pulseloco", j, 0.3, 180.0), **swarm, "payload_bytes_per_worker": 100.0 + 20 * j,
           "wire_bytes_per_round": 90.0, "payload_bytes_per_round": 50.0 + 10 * j, "entries_per_round": 10.0,
           "bytes_per_entry": {**split, "index_bytes": 1.0 + j, "wire_bytes": 9.0 + j}} for j in range(2)),
        fake_run("sparseloco", 0, 0.3, 300.0),  # from a compare.json written before these fields
    ]  # fmt: skip
    rows = {r["strategy"]: r for r in compare_results.aggregate(runs)}
    ddp, diloco, pulse, sparse = rows["ddp"], rows["diloco"], rows["pulseloco"], rows["sparseloco"]
    assert ddp["steps_per_round"] == 8  # the swarm's round: ddp's bytes over 8 of its 16 steps
    assert ddp["wire_bytes_per_round"] == 8000 and ddp["payload_bytes_per_round"] == 16000
    assert pulse["payload_bytes_per_worker"] == 110 and pulse["payload_bytes_per_round"] == 55
    assert pulse["payload_vs_diloco"] == pytest.approx(110 / 820)
    assert pulse["payload_vs_ddp"] == pytest.approx(110 / 32000)
    assert pulse["vs_diloco"] == pytest.approx(180 / 1600) and diloco["payload_vs_diloco"] == 1.0
    entry = pulse["bytes_per_entry"]  # means over the two seeds: the parts still add up to the wire bytes
    assert entry["index_bytes"] == 1.5 and entry["wire_bytes"] == 9.5
    assert entry["index_bytes"] + entry["value_bytes"] + entry["sum_bytes"] + entry["header_bytes"] == 9.5
    assert sparse["payload_vs_diloco"] is None and sparse["bytes_per_entry"] is None
    assert sparse["wire_bytes_per_round"] is None and sparse["vs_diloco"] == pytest.approx(300 / 1600)
    lines = compare_report.byte_tables(list(rows.values()))
    assert "| ddp | 8.0 kB (est.) | 8.0 kB (est.) | 10x | 1x | 16.0 kB (est.) | 39x | 1x | 0.50 | 0.50 |" in lines
    assert "| pulseloco | 10 | 9.50 | 1.50 | 3.00 | 4.50 | 0.500 | 5.00 | 8.00 / 7.00 / 6.00 |" in lines
    assert "| sparseloco | - | - | 1/5.33 | 1/53.3 | - | - | - | - | - |" in lines
    assert not any(line.startswith(("| diloco | 1", "| ddp | -")) for line in lines)  # not in the split table


def test_without_a_ddp_run_vs_ddp_is_against_the_estimate_a_ddp_run_would_report() -> None:
    """The default comparison runs no ddp (its bytes are never measured, only estimated): 'vs DDP' is then against
    the same estimate, from the runs' parameters, workers and steps: a ring all-reduce of FP32 gradients every
    step, 2 (W - 1) / W x 4 x N x steps (4 workers, 1000 parameters, 16 steps: 96,000 bytes), and 4 N per step for
    the payload (64,000); a ddp run's own row wins where there is one; no estimate without the fields."""
    known = {"num_params": 1000, "workers": 4, "steps": 16, "rounds": 2}
    runs = [
        {**fake_run("diloco", 0, 0.3, 64000.0), **known, "payload_bytes_per_worker": 64000.0},
        {**fake_run("pulseloco", 0, 0.3, 960.0), **known, "payload_bytes_per_worker": 320.0},
    ]
    rows = {r["strategy"]: r for r in compare_results.aggregate(runs)}
    assert rows["pulseloco"]["ddp_bytes_estimate"] == 96000 and rows["pulseloco"]["vs_ddp"] == pytest.approx(0.01)
    assert rows["pulseloco"]["payload_vs_ddp"] == pytest.approx(320 / 64000)
    ddp = {**fake_run("ddp", 0, 0.3, 192000.0), **known, "rounds": 0, "bytes_measured": False}
    rows = {r["strategy"]: r for r in compare_results.aggregate([*runs, ddp])}
    assert rows["pulseloco"]["vs_ddp"] == pytest.approx(960 / 192000)
    bare = {r["strategy"]: r for r in compare_results.aggregate([fake_run("pulseloco", 0, 0.3, 960.0)])}
    assert bare["pulseloco"]["ddp_bytes_estimate"] is None and bare["pulseloco"]["vs_ddp"] is None


def test_sent_and_received_bytes_per_round_side_by_side_and_in_payloads() -> None:
    """Wire bytes sent and received per worker and round, beside each other, and both in payloads (over the payload
    bytes per round): 4 workers, 2 rounds, a payload of 1,000 bytes a round; diloco's sums exchange sends and
    receives 1.5 payloads a round, the all-gather relays 2.25 and receives 3 (W - 1), top-k's aggregate about one.
    A result of an older compare.json without ``received_bytes_per_round`` gets it from its ``traffic``; ddp's
    estimate receives what it sends (2 (W - 1) / W = 1.5 of its 4 N bytes a step: 1,500 of 1,000)."""
    known = {"num_params": 250, "workers": 4, "steps": 16, "rounds": 2}  # 4 N = 1,000 bytes

    def swarm(strategy: str, sent: float, received: float) -> dict[str, Any]:
        return {**fake_run(strategy, 0, 0.3, 2 * sent), **known, "bytes_received_per_worker": 2 * received,
                "payload_bytes_per_worker": 2000.0, "wire_bytes_per_round": sent,
                "received_bytes_per_round": received, "payload_bytes_per_round": 1000.0}  # fmt: skip

    old = swarm("sparseloco-topk", 1100.0, 900.0)
    del old["received_bytes_per_round"]
    old["traffic"] = {"rounds": 8, "bytes_received": 8 * 900, "bytes_sent": 8 * 1100}  # 4 peers x 2 rounds
    # ddp: 16 steps of 1,500 wire and 1,000 payload bytes
    ddp = {**fake_run("ddp", 0, 0.3, 24000.0), **known, "rounds": 0, "bytes_measured": False,
           "payload_bytes_per_worker": 16000.0}  # fmt: skip
    runs = [swarm("diloco", 1500.0, 1500.0), swarm("sparseloco-gather", 2250.0, 3000.0), old, ddp]
    rows = {r["strategy"]: r for r in compare_results.aggregate(runs)}
    gather, topk, diloco = rows["sparseloco-gather"], rows["sparseloco-topk"], rows["diloco"]
    assert (gather["wire_bytes_per_round"], gather["received_bytes_per_round"]) == (2250, 3000)
    assert gather["bytes_received_per_worker"] == 6000 and gather["vs_diloco"] == 1.5
    assert (gather["payloads_sent_per_round"], gather["payloads_received_per_round"]) == (2.25, 3.0)
    assert (diloco["payloads_sent_per_round"], diloco["payloads_received_per_round"]) == (1.5, 1.5)
    assert topk["received_bytes_per_round"] == 900 and topk["payloads_received_per_round"] == 0.9
    assert rows["ddp"]["bytes_received_per_worker"] == 24000  # received = sent, its estimate
    assert rows["ddp"]["wire_bytes_per_round"] == rows["ddp"]["received_bytes_per_round"] == 12000  # 8 of 16 steps
    assert rows["ddp"]["payloads_sent_per_round"] == rows["ddp"]["payloads_received_per_round"] == 1.5
    lines = compare_report.byte_tables(list(rows.values()))
    assert lines[0].startswith(
        "| strategy | wire B sent / worker / round | wire B received / worker / round | sent vs DiLoCo | sent vs DDP "
        "| payload B / worker / round |"
    )
    assert lines[0].endswith("| payloads sent / round | payloads received / round |")
    assert len(lines[0].split(" | ")) == len(lines[1].split("|")) - 2 == 10
    assert "| sparseloco-gather | 2.2 kB | 3.0 kB | 1.5x | 1/5.33 | 1.0 kB | 1x | 1/8 | 2.25 | 3.00 |" in lines
    assert "| diloco | 1.5 kB | 1.5 kB | 1x | 1/8 | 1.0 kB | 1x | 1/8 | 1.50 | 1.50 |" in lines
    assert "| ddp | 12.0 kB (est.) | 12.0 kB (est.) | 8x | 1x | 8.0 kB (est.) | 8x | 1x | 1.50 | 1.50 |" in lines
    assert any(line.startswith("| sparseloco-topk | 1.1 kB | 900 B |") for line in lines)
    no_payload = compare_results.aggregate([{**swarm("pulseloco", 10.0, 20.0), "payload_bytes_per_round": None}])
    assert no_payload[0]["payloads_sent_per_round"] is None and no_payload[0]["payloads_received_per_round"] is None


def test_summarize_reports_the_received_bytes_of_every_peers_rounds(tmp_path: Path) -> None:
    """summarize() over two peers' pulseloco_rounds.jsonl (2 rounds each): bytes received per worker over the run
    and per worker and round, beside the bytes sent."""
    workers = []
    for peer, (sent, received) in enumerate(((100, 300), (200, 500))):
        out = tmp_path / f"peer{peer}"
        out.mkdir()
        (out / "trainer_state.json").write_text(json.dumps({"global_step": 16, "log_history": []}))
        records = [{"round": r, "num_peers": 2, "density": 0.5, "bytes_sent": sent, "bytes_received": received,
                    "payload_bytes": 50, "seconds_inner": 1.0, "seconds_sync": 0.5, "num_sent": 10, "numel": 20}
                   for r in range(2)]  # fmt: skip
        (out / "pulseloco_rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        workers.append(out)
    run = compare_runs.StrategyRun(compare_runs.Plan("sparseloco-gather", 1e-5, 0, 0), workers=workers)
    result = compare_results.summarize(run, "grpo", 2)
    assert result["bytes_per_worker"] == 300 and result["bytes_received_per_worker"] == 800  # (2x100 + 2x200) / 2
    assert result["wire_bytes_per_round"] == 150 and result["received_bytes_per_round"] == 400
    assert result["payload_bytes_per_round"] == 50 and result["traffic"]["bytes_received"] == 1600
    row = compare_results.aggregate([result])[0]
    assert (row["payloads_sent_per_round"], row["payloads_received_per_round"]) == (3.0, 8.0)


class _Recorder(Runner):
    """A runner that records what it would start (name, command line, namespace) and starts nothing."""

    def __init__(self, log_dir: Path, netns: NetNS | None) -> None:
        super().__init__(log_dir, netns=netns)
        self.started: list[tuple[str, list[str], int | None]] = []

    def start(self, name: str, argv: list[str], **kwargs: Any) -> Any:  # type: ignore[override]
        self.started.append((name, argv, kwargs.get("ns_index")))
        return None


@pytest.mark.parametrize("bandwidth", [False, True])
def test_sixteen_workers_start_sixteen_peers_each_with_an_address_of_its_own(tmp_path: Path, bandwidth: bool) -> None:
    """--workers 16 is accepted and nothing caps it: a swarm strategy starts 16 peers in rounds of 16, each (with
    --bandwidth) in its own namespace at its own address; ddp 16 processes (one launch on loopback, else 16
    machines of one, ranks 0-15). Nothing is started: the command lines are checked."""
    ap = compare.build_parser()
    args = ap.parse_args(["--workers", "16", "--strategies", "ddp,sparseloco-gather", "--quick"])
    strategies, _, _, _ = compare.validate(ap, args, [])
    assert args.workers == 16 and strategies == ["ddp", "sparseloco-gather"]
    netns = NetNS(args.workers + 1, "100mbit", prefix="plcmp") if bandwidth else None  # never set up here
    runner = _Recorder(tmp_path, netns)
    for strategy in strategies:
        compare_runs.start_run(runner, args, compare_runs.Plan(strategy, 5e-5, 0, 0), "/ip4/10.77.0.10/tcp/1", [], None)
    swarm = [(argv, ns) for name, argv, ns in runner.started if "-peer" in name]
    assert len(swarm) == 16 and len({argv[argv.index("--output_dir") + 1] for argv, _ in swarm}) == 16
    assert {argv[argv.index("--target_group_size") + 1] for argv, _ in swarm} == {"16"}
    assert len({argv[argv.index("--seed") + 1] for argv, _ in swarm}) == 16
    ddp = [argv for name, argv, _ in runner.started if "-peer" not in name]
    if netns is None:
        assert len(ddp) == 1 and ddp[0][ddp[0].index("--num_processes") + 1] == "16"
        assert all(ns is None and "--host_maddrs" not in argv for argv, ns in swarm)
        return
    assert sorted(ns for _, ns in swarm) == list(range(1, 17))  # namespace 0: the bootstrap node
    hosts = [argv[argv.index("--host_maddrs") + 1] for argv, _ in swarm]
    assert len(set(hosts)) == 16 and all(h.startswith("/ip4/10.77.0.") and h.endswith("/tcp/0") for h in hosts)
    assert max(int(h.split("/")[2].rsplit(".", 1)[1]) for h in hosts) < 255
    assert len({netns.peer_ns(i) for i in range(17)}) == 17
    assert [argv[argv.index("--machine_rank") + 1] for argv in ddp] == [str(i) for i in range(16)]
    assert {argv[argv.index("--num_machines") + 1] for argv in ddp} == {"16"}


def test_seed_and_learning_rate_plans() -> None:
    assert compare.parse_lrs("1e-6,3e-6") == [1e-6, 3e-6]
    assert compare.parse_seeds("3", 2) == [3, 3] and compare.parse_seeds("1,3", 2) == [1, 3]
    for bad in ("0", "1,2,3", "x"):
        with pytest.raises(ValueError):
            compare.parse_seeds(bad, 2)
    for bad in ("1e-6,-1", "nan", "fast"):
        with pytest.raises(ValueError):
            compare.parse_lrs(bad)
    plans = compare_runs.make_plans(["diloco", "pulseloco"], [1e-6, 1e-5], [1, 2], base_seed=7, reference=True)
    assert [(p.strategy, p.lr, p.seed, p.limited) for p in plans] == [
        ("diloco", 1e-6, 7, False), ("pulseloco", 1e-6, 7, False),
        ("diloco", 1e-6, 7, True), ("pulseloco", 1e-6, 7, True),
        ("diloco", 1e-5, 7, True), ("pulseloco", 1e-5, 7, True),
        ("diloco", 1e-5, 1007, True), ("pulseloco", 1e-5, 1007, True),
    ]  # fmt: skip
    assert len({p.tag for p in plans}) == 4  # one output directory per learning rate, seed and network


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lrs", "1e-6,3e-6", "--seeds", "1,2,3"], "3 counts for 2 learning rates"),
        (["--lrs=-1e-6"], "not a positive learning rate"),
        (["--strategies", "diloco,fedavg"], "unknown fedavg"),
        (["--lrs", "1e-6", "--", "--learning_rate", "1e-3"], "with --lrs, not --learning_rate"),
        (["--report", "bad.json"], "not a compare.json this script wrote"),
    ],
)
def test_bad_flags_are_refused_before_anything_starts(tmp_path: Path, flags: list[str], message: str) -> None:
    if "--report" in flags:
        (tmp_path / "bad.json").write_text('{"meta": {}}')
    out, runs = tmp_path / "results", tmp_path / "runs"
    argv = [sys.executable, str(SCRIPT), "--out", str(out), "--runs-dir", str(runs), *flags]
    proc = run_compare(argv, timeout=50, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists() and not runs.exists()


def assert_one_line_refusal(proc: subprocess.CompletedProcess[str], tmp: Path, out: Path) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and not proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in lines[0]
    assert "scripts/demo.sh" in lines[0] and "scripts/test.sh" in lines[0]
    assert ".venv/bin/python experiments/compare/compare.py" in lines[0]
    assert list(tmp.iterdir()) == [] and not out.exists()  # no runs directory, nothing written
    return lines[0]


@pytest.mark.timeout(60)
def test_python_without_the_dependencies_gets_one_line(tmp_path: Path) -> None:
    """The system Python (isolated: no user site-packages), as a new user who ran
    `python3 experiments/compare/compare.py`."""
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"no {SYSTEM_PYTHON}")
    probe = subprocess.run([str(SYSTEM_PYTHON), "-I", "-c", HAS_DEPS], check=False,
                           capture_output=True, timeout=60)  # fmt: skip
    if probe.returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has the project's dependencies")
    tmp, out = tmp_path / "tmp", tmp_path / "results"
    tmp.mkdir()
    argv = [str(SYSTEM_PYTHON), "-I", str(SCRIPT), "--out", str(out), "--steps", "8"]
    proc = run_compare(argv, timeout=50, env=dict(os.environ, TMPDIR=str(tmp)))
    line = assert_one_line_refusal(proc, tmp, out)
    assert "lacks the project's dependencies" in line


@pytest.mark.timeout(60)
def test_python_without_the_pulseloco_command_beside_it_gets_one_line(tmp_path: Path) -> None:
    """A virtual environment with the packages but no `pulseloco` command beside its python: this venv's
    pyvenv.cfg and lib/ behind a bin/ that holds only the interpreter."""
    cfg = Path(sys.prefix) / "pyvenv.cfg"
    if not cfg.exists() or not (Path(sys.prefix) / "lib").is_dir():
        pytest.skip("the tests do not run in a virtual environment")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(cfg, venv / "pyvenv.cfg")
    (venv / "lib").symlink_to(Path(sys.prefix) / "lib")
    python = venv / "bin" / "python"
    python.symlink_to(os.path.realpath(sys.executable))
    probe = subprocess.run([str(python), "-c", HAS_DEPS], check=False,
                           capture_output=True, timeout=60)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip("this venv's layout cannot be borrowed by another bin/ directory")
    tmp, out = tmp_path / "tmp", tmp_path / "results"
    tmp.mkdir()
    proc = run_compare([str(python), str(SCRIPT), "--out", str(out)], timeout=50, env=dict(os.environ, TMPDIR=str(tmp)))
    line = assert_one_line_refusal(proc, tmp, out)
    assert "no pulseloco command" in line and "no module" not in line


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # the default: the RL-rate regime, one seed of the seven strategies of the frontier, 32 held-out samples
        ([], ("wide", [3e-6], [1], 192, DEFAULT_STRATEGIES, "32")),
        # the frontier's three strategies with three seeds, at the same rate and model
        (
            ["--seeds", "3", "--strategies", "diloco,sparseloco,pulseloco-2bit-k64"],
            ("wide", [3e-6], [3], 192, ["diloco", "sparseloco", "pulseloco-2bit-k64"], "32"),
        ),
        # --quick: the demo model, ddp and the default's seven, the recipe's own number of held-out samples
        (["--quick"], ("demo", [5e-5], [1], 32, ["ddp", *DEFAULT_STRATEGIES], None)),
        # what the user gives wins, after -- as before it
        (
            ["--warm-size", "tiny", "--steps", "8", "--", "--num_eval_samples", "4"],
            ("tiny", [3e-6], [1], 8, DEFAULT_STRATEGIES, "4"),
        ),
    ],
)
def test_defaults_are_the_rl_rate_regime_and_what_is_given_wins(
    flags: list[str], expected: tuple[str, list[float], list[int], int, list[str], str | None]
) -> None:
    argv, extra = (flags[: flags.index("--")], flags[flags.index("--") + 1 :]) if "--" in flags else (flags, [])
    ap = compare.build_parser()
    args = ap.parse_args(argv)
    strategies, lrs, seeds, extra = compare.validate(ap, args, extra)
    samples = extra[extra.index("--num_eval_samples") + 1] if "--num_eval_samples" in extra else None
    assert (args.warm_size, lrs, seeds, args.steps, strategies, samples) == expected
    assert extra.count("--num_eval_samples") <= 1


def test_strategies_are_the_recipe_flags_of_the_frontier() -> None:
    assert compare_runs.STRATEGIES == {
        "ddp": ("ddp", []),
        "diloco": ("diloco", []),
        "pulseloco": ("pulseloco", []),
        "pulseloco-bf16": ("pulseloco", ["--pulse_values", "bfloat16"]),
        "sparseloco": ("sparseloco", []),
        "sparseloco-k128": ("sparseloco", ["--topk_k", "128"]),
        "pulseloco-2bit": ("pulseloco", ["--pulse_values", "quantized"]),
        "pulseloco-2bit-k64": ("pulseloco", ["--pulse_values", "quantized", "--pulse_budget", "64"]),
        "sparseloco-gather": ("sparseloco", ["--exchange", "gather"]),
        "sparseloco-topk": ("sparseloco", ["--exchange", "topk"]),
        "sparseloco-topk-x1": ("sparseloco", ["--exchange", "topk", "--exchange_budget", "1"]),
        "sparseloco-topk-x4": ("sparseloco", ["--exchange", "topk", "--exchange_budget", "4"]),
        "pulseloco-2bit-topk": ("pulseloco", ["--pulse_values", "quantized", "--exchange", "topk"]),
        "pulseloco-topk": ("pulseloco", ["--exchange", "topk"]),
        "diloco-published": ("diloco", ["--clip_to_median", "false"]),
        "pulseloco-published": ("pulseloco", ["--clip_to_median", "false"]),
        "diloco-overlap": ("diloco", ["--overlap", "true"]),
        "sparseloco-overlap": ("sparseloco", ["--overlap", "true"]),
    }
    assert ["ddp", *DEFAULT_STRATEGIES] == compare_runs.CORE_STRATEGIES
    args = compare.argparse.Namespace(recipe="grpo", config=TINY_CONFIG, steps=16, model_name_or_path=None)
    plan = compare_runs.Plan("pulseloco-2bit-k64", 3e-6, 0, 0)
    argv = compare_runs.recipe_argv(args, plan, Path("out"), ["--num_eval_samples", "32"], peer=1)
    start = argv.index("--strategy")
    assert argv[start : start + 6] == ["--strategy", "pulseloco", "--pulse_values", "quantized", "--pulse_budget", "64"]
    assert argv[argv.index("--seed") + 1] == "1" and argv[-2:] == ["--num_eval_samples", "32"]
    argv = compare_runs.recipe_argv(args, compare_runs.Plan("diloco-published", 3e-6, 0, 0), Path("out"), [])
    start = argv.index("--strategy")
    assert argv[start : start + 4] == ["--strategy", "diloco", "--clip_to_median", "false"]


def test_every_strategy_parses_as_the_recipes_parse_its_flags() -> None:
    """Each strategy's ``--strategy`` and flags as the recipes parse them (HfArgumentParser over the pulseloco
    options, each group checked): the exchange variants name their exchange, the others run ``auto``; the
    published baselines run without the median clip (``--clip_to_median false``), the others with it."""
    from transformers import HfArgumentParser

    from pulseloco.integrations.args import PulseLoCoArguments

    parser = HfArgumentParser((PulseLoCoArguments,))
    for name, (strategy, flags) in compare_runs.STRATEGIES.items():
        (options,) = parser.parse_args_into_dataclasses(["--strategy", strategy, *flags])
        averaging = options.averaging_config()
        assert averaging.clip_to_median is not name.endswith("-published"), name
        exchange = "gather" if name.endswith("-gather") else "topk" if "-topk" in name else "auto"
        assert averaging.exchange == exchange, name
        budget = {"-x1": 1.0, "-x4": 4.0}.get(name[-3:], 2.0)
        assert averaging.exchange_budget == budget, name
        assert options.round_config().overlap is name.endswith("-overlap"), name


def test_every_strategy_has_a_color_and_line_style_of_its_own() -> None:
    styles = compare_report.plot_styles([*compare_runs.STRATEGIES, "fedavg", "topk-old"])
    known = [styles[s] for s in compare_runs.STRATEGIES]
    assert all(s in compare_report.STYLES for s in compare_runs.STRATEGIES)
    assert len({color for color, _, _ in known}) == len(known) == len(compare_runs.STRATEGIES) == 18
    assert len({(color, str(line), marker) for color, line, marker in styles.values()}) == len(styles)


def frontier_run(strategy: str, seed_index: int, after: float, sent: float, payload: float) -> dict[str, Any]:
    """A run with the held-out sampled reward (from 0.30 ± 0.01 to ``after`` ± 0.01), wire and payload bytes per
    worker and a curve: every field the tables and plots read."""
    return {**sampled_run(strategy, seed_index, after), "bytes_per_worker": sent, "payload_bytes_per_worker": payload,
            "curve": [(sent / 2, 5.0, 0.3), (sent, 10.0, after)], "num_params": 1000, "workers": 4, "steps": 16,
            "rounds": 2}  # fmt: skip


def frontier_runs(seeds: int) -> list[dict[str, Any]]:
    """diloco (1,460,000 wire and 1,800,000 payload bytes per worker) and every other strategy but ddp; with 3 seeds
    diloco's range is [0.34, 0.36]: sparseloco (1/146 and 1/180 of diloco's bytes) and pulseloco-2bit (1/50) lie
    within it, pulseloco-2bit-k64 (1/200) lies below it, sparseloco-k128 did not learn."""
    afters = {
        "diloco": (0.35, 0.34, 0.36), "pulseloco": (0.35, 0.35, 0.35), "pulseloco-bf16": (0.35, 0.345, 0.35),
        "sparseloco": (0.35, 0.345, 0.355), "sparseloco-k128": (0.31, 0.35, 0.35), "pulseloco-2bit": (0.35,) * 3,
        "pulseloco-2bit-k64": (0.335, 0.335, 0.335),
    }  # fmt: skip
    sent = {"diloco": 1.46e6, "pulseloco": 1.46e5, "pulseloco-bf16": 7.3e4, "sparseloco": 1e4,
            "sparseloco-k128": 2e4, "pulseloco-2bit": 2.92e4, "pulseloco-2bit-k64": 7.3e3}  # fmt: skip
    ratio = {name: 1.8e6 * b / 1.46e6 for name, b in sent.items()}
    ratio["sparseloco"] = 1e4
    return [
        frontier_run(name, j, after, sent[name], ratio[name])
        for name, values in afters.items()
        for j, after in enumerate(values[:seeds])
    ]


def _without_fp32_cell(lines: list[str]) -> list[str]:
    """The frontier table's lines without the "wire / payload vs FP32 DiLoCo" cell (checked on its own)."""
    out = []
    for line in lines:
        cells = line.split(" | ")
        out.append(" | ".join(cells[:4] + cells[5:]) if line.startswith("| ") and len(cells) == 8 else line)
    return out


def test_frontier_table_and_targets_with_three_seeds() -> None:
    rows = compare_results.aggregate(frontier_runs(3))
    full = compare_report.frontier_table(rows)
    assert "| wire / payload vs FP32 DiLoCo |" in full[0]
    # FP32 DiLoCo over the runs' 2 rounds: 2 (4-1)/4 x 4 x 1,000 x 2 = 12,000 wire and 8,000 payload bytes
    assert any(line.startswith("| diloco | 1.5 MB | 1x | 1x | 122x / 225x |") for line in full)
    lines = _without_fp32_cell(full)
    assert lines[0].startswith("| strategy | wire B / worker | wire vs DiLoCo | payload vs DiLoCo |")
    body = [line for line in lines[2:] if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in body][:2] == ["| diloco", "| pulseloco"]  # most wire bytes first
    assert "| diloco | 1.5 MB | 1x | 1x | 0.350 [0.340, 0.360] (3 seeds) | yes | reference |" in lines
    assert "| sparseloco | 10.0 kB | 1/146 | 1/180 | 0.350 [0.345, 0.355] (3 seeds) | yes | yes |" in lines
    assert (
        "| pulseloco-2bit-k64 | 7.3 kB | 1/200 | 1/200 | 0.335 [0.335, 0.335] (3 seeds) | yes | no: below its range |"
        in lines
    )
    assert any(line.startswith("| sparseloco-k128 |") and line.endswith("| no | not judged: did not learn |")
               for line in lines)  # fmt: skip
    caption = "- frontier (`frontier.png`): error bars min to max over seeds (strategies with 2 or more seeds)."
    assert caption in lines
    targets = compare_report.target_lines(rows)
    assert any(t.startswith("- pulseloco-2bit-k64 targets: bytes vs DiLoCo 1/200 (met)") for t in targets)
    sparse = next(t for t in targets if t.startswith("- sparseloco (k = 64) targets"))
    assert "wire bytes vs DiLoCo 1/146 (met), payload vs DiLoCo 1/180 (met) (against FP32 DiLoCo: wire" in sparse
    assert "; quality: mean of the held-out" in sparse
    # the fewest wire bytes at DiLoCo's quality: sparseloco (10 kB), not pulseloco-2bit-k64 (fewer, but below range)
    assert targets[-1] == "- best strategy at DiLoCo's quality: sparseloco, wire bytes vs DiLoCo 1/146 (met)."
    best, why = compare_report.best_at_diloco_quality([r for r in rows if r["strategy"] != "sparseloco"])
    assert best is not None and best["strategy"] == "pulseloco-2bit" and why == ""  # 29.2 kB
    assert compare_report.verdict(best["vs_diloco"], compare_report.TARGETS["best_at_diloco_quality"]) == (
        "1/50 (missed by 2.9x)"
    )


def test_frontier_with_one_seed_shows_the_sampling_error_and_judges_no_quality() -> None:
    rows = compare_results.aggregate(frontier_runs(1))
    lines = _without_fp32_cell(compare_report.frontier_table(rows))
    assert "| sparseloco | 10.0 kB | 1/146 | 1/180 | 0.350 ± 0.010 (s.e.) | yes | not judged: DiLoCo has 1 seed |" in (
        lines
    )
    assert any("sampling standard error of one seed" in line for line in lines[-4:])
    assert compare_report.target_lines(rows)[-1] == (
        "- best strategy at DiLoCo's quality (target <= 1/146 of DiLoCo's wire bytes): none (quality is not judged: "
        "DiLoCo needs at least 2 seeds for a range)."
    )
    no_diloco = compare_results.aggregate([r for r in frontier_runs(1) if r["strategy"] != "diloco"])
    assert "none (no diloco run to compare with)" in compare_report.target_lines(no_diloco)[-1]
    assert compare_report.frontier_table(compare_results.aggregate([fake_run("diloco", 0, 0.3, 1.0)])) == []


def fake_meta(**overrides: Any) -> dict[str, Any]:
    """A compare.json's meta as make_meta() writes it (the fields the report reads and merge_reports compares)."""
    return {
        "command": ".venv/bin/python experiments/compare/compare.py", "recipe": "grpo",
        "recipe_path": "recipes/grpo.py",
        "config": "recipes/configs/grpo-demo.yaml", "model": "/models/warm-wide", "strategies": ["diloco"],
        "lrs": [1e-5], "seeds": [1], "seed_note": "0 + 1000 j", "steps": 16, "extra": ["--num_eval_samples", "32"],
        "workers": 4, "parallel": False, "network": "loopback", "bandwidth": None, "ddp_launch": "one launch",
        "metric_label": "greedy reward", "metric_sources": ["greedy"], "curve_label": "sampled reward",
        "metric_note": "greedy", "targets": compare_report.TARGETS, "seconds": 600.0, "date": "today",
        "commit": "abc1234", "machine": "2 cores", **overrides,
    }  # fmt: skip


def test_outputs_of_eight_strategies_with_the_frontier_plot(tmp_path: Path) -> None:
    runs = frontier_runs(3) + [
        {**frontier_run("ddp", j, 0.35, 9.6e6, 6.4e7), "bytes_measured": False, "rounds": 0} for j in range(3)
    ]
    meta = fake_meta(strategies=list(compare_runs.STRATEGIES))
    compare_report.write_outputs(tmp_path, tmp_path / "compare.json", runs, meta)
    for name in (*meta["plots"], "compare.md", "compare.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert meta["plots"][-1] == "frontier.png" and len(meta["plots"]) == 5
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "compare.md").read_text()
    assert "| ddp | 9.6 MB (est.) | 6.58x | 35.6x |" in md and "## Reported from" not in md


def test_report_merges_compare_jsons_and_refuses_other_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two files run with the same settings are reported as one (the later file's run where both have the same
    strategy, learning rate and seed), their sources listed; other settings are refused. The plots are tested
    above (here they are not drawn: seconds each)."""
    monkeypatch.setattr(compare_report, "plot", lambda *args: [])
    first = [r for r in frontier_runs(1) if r["strategy"] in ("diloco", "pulseloco")]
    second = [r for r in frontier_runs(3) if r["strategy"] in ("diloco", "sparseloco")]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"meta": fake_meta(strategies=["diloco", "pulseloco"]), "results": first}))
    meta_b = fake_meta(strategies=["diloco", "sparseloco"], seeds=[3], commit="def5678", command="three seeds")
    b.write_text(json.dumps({"meta": meta_b, "results": second}))
    out = tmp_path / "out"
    assert compare.main(["--report", f"{a},{b}", "--out", str(out)]) == 0
    report = json.loads((out / "compare.json").read_text())
    rows = {r["strategy"]: r for r in report["rows"]}
    assert set(rows) == {"diloco", "pulseloco", "sparseloco"} and len(report["results"]) == 7
    assert rows["diloco"]["seeds"] == 3 and rows["pulseloco"]["seeds"] == 1  # b's diloco seed 0 replaced a's
    assert report["meta"]["strategies"] == ["diloco", "pulseloco", "sparseloco"] and report["meta"]["seeds"] == [3]
    assert report["meta"]["seconds"] == 1200 and report["meta"]["targets"] == compare_report.TARGETS
    md = (out / "compare.md").read_text()
    assert "Runs of 2 compare.json (20 min in all), listed under 'Reported from'." in md
    command = ".venv/bin/python experiments/compare/compare.py"
    assert f"- `{a}`: commit abc1234, today, 2 cores, `{command}`; runs kept: " in md
    assert "runs kept: pulseloco x1." in md
    assert f"- `{b}`: commit def5678" in md and "runs kept: diloco x3, sparseloco x3; replaced 1 run(s)" in md
    assert "- best strategy at DiLoCo's quality: sparseloco, wire bytes vs DiLoCo 1/146 (met)." in md
    # the merged file again, with the flag repeated: its sources are listed, and the rows are the same
    again = tmp_path / "again"
    assert compare.main(["--report", str(out / "compare.json"), "--out", str(again)]) == 0
    text = (again / "compare.md").read_text()
    assert f"itself reported from `{a}` (commit abc1234); `{b}` (commit def5678)" in text
    assert json.loads((again / "compare.json").read_text())["rows"] == report["rows"]
    assert compare.main(["--report", str(a), "--report", str(b), "--out", str(again)]) == 0
    capsys.readouterr()

    c = tmp_path / "c.json"  # other steps and workers: refused, nothing written
    c.write_text(json.dumps({"meta": fake_meta(steps=32, workers=2), "results": first}))
    refused = tmp_path / "refused"
    assert compare.main(["--report", f"{a},{c}", "--out", str(refused)]) == 2
    err = capsys.readouterr().err
    assert f"{c} was run with other settings than {a} (steps: 16 vs 32; workers: 4 vs 2)" in err
    assert len(err.splitlines()) == 1 and not refused.exists()
    with pytest.raises(SystemExit) as exc:
        compare.main(["--report", f"{a},{a}", "--out", str(refused)])
    assert exc.value.code == 2 and "given more than once" in capsys.readouterr().err


def test_a_strategy_above_dilocos_range_is_at_its_quality() -> None:
    """Better than DiLoCo is at DiLoCo's quality: a mean above its range counts for the best-strategy target."""
    runs = [r for r in frontier_runs(3) if r["strategy"] in ("diloco", "pulseloco-2bit-k64")]
    for r in runs:
        if r["strategy"] == "pulseloco-2bit-k64":
            r["sampled_after"] = 0.40  # diloco's range is [0.34, 0.36]
    rows = compare_results.aggregate(runs)
    k64 = next(r for r in rows if r["strategy"] == "pulseloco-2bit-k64")
    diloco = next(r for r in rows if r["strategy"] == "diloco")
    assert k64["within_diloco_range"] is False and k64["above_diloco_range"] is True
    assert compare_report.match_cell(k64, diloco) == "yes: above its range"
    assert "mean of the held-out sampled reward 0.400 above DiLoCo's range" in compare_report.quality_verdict(
        k64, diloco
    )
    best, _ = compare_report.best_at_diloco_quality(rows)
    assert best is not None and best["strategy"] == "pulseloco-2bit-k64"
