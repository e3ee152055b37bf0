"""Recipe smoke tests: real ``accelerate launch`` runs of recipes/ on the tiny config, on 127.0.0.1.

Each test starts the recipes as separate processes (several at once where they are independent, to keep the
file to a few minutes on two CPU cores), waits for them with a timeout, and checks their metrics files:
``ddp`` with two processes and a resume, single ``diloco`` and ``sparseloco`` peers, two ``pulseloco`` GRPO peers
publishing to a rollout worker, and the one-line errors of bad configurations. Processes are killed and reaped
on failure here and by tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
TINY = RECIPES / "configs" / "tiny.yaml"
ACCELERATE = [str(Path(sys.executable).parent / "accelerate"), "launch"]
LAUNCH_FLAGS = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
RUN_TIMEOUT_S = 240.0
"""Upper bound for one recipe run (they take well under a minute on an idle two-core machine)."""


class Run:
    """A recipe process whose stdout and stderr go to a log file."""

    def __init__(self, argv: Sequence[str], log: Path, cwd: Path) -> None:
        self.log = log
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
        with log.open("wb") as fh:
            self.proc = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.text())
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"{self.log.name}: no line matching {pattern!r}; log:\n{self.text()[-3000:]}")

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> str:
        """Wait for exit code 0; returns the log."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.log.name} did not finish in {timeout:.0f} s; log:\n{self.text()[-3000:]}"
            ) from None
        assert code == 0, f"{self.log.name} exited with {code}; log:\n{self.text()[-3000:]}"
        return self.text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    """Processes a test starts; killed if still running when it ends."""
    started: list[Run] = []
    yield started
    for run in started:
        run.kill()


def launch(runs: list[Run], tmp_path: Path, name: str, recipe: str, *args: str, num_processes: int = 1) -> Run:
    """``accelerate launch`` a recipe with the tiny config, output in ``tmp_path/name``."""
    multi = ["--multi_gpu"] if num_processes > 1 else []
    argv = [*ACCELERATE, *multi, "--num_processes", str(num_processes), *LAUNCH_FLAGS, str(RECIPES / recipe)]
    argv += ["--config", str(TINY), "--output-dir", str(tmp_path / name), *args]
    run = Run(argv, tmp_path / f"{name}.log", tmp_path)
    runs.append(run)
    return run


def metrics(tmp_path: Path, name: str, event: str) -> list[dict[str, Any]]:
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["event"] == event]


FAST_SWARM = ["--matchmaking-time", "3", "--target-group-size", "1", "--linger", "0"]
"""A lone peer: form each round's group at once and leave right after the last round."""


def test_ddp_two_processes_then_resume_in_one(runs: list[Run], tmp_path: Path) -> None:
    launch(runs, tmp_path, "ddp", "pretrain.py", "--strategy", "ddp", "--steps", "8", num_processes=2).wait()
    steps = metrics(tmp_path, "ddp", "step")
    assert [s["step"] for s in steps] == [4, 8]
    assert steps[-1]["bytes_sent_total"] > 0  # all-reduce estimate: zero with one process
    assert all(s["loss"] > 0 for s in steps)
    start = metrics(tmp_path, "ddp", "start")
    assert start[0]["config"]["swarm"]["strategy"] == "ddp"
    # Resume the 2-process run in one plain process (no launcher): same checkpoint, continues at step 8.
    argv = [sys.executable, str(RECIPES / "pretrain.py"), "--config", str(TINY), "--output-dir", str(tmp_path / "ddp")]
    resumed = Run([*argv, "--strategy", "ddp", "--steps", "12", "--resume"], tmp_path / "resume.log", tmp_path)
    runs.append(resumed)
    log = resumed.wait()
    assert "steps 8->12" in log
    steps = metrics(tmp_path, "ddp", "step")
    assert [s["step"] for s in steps] == [4, 8, 12]
    assert len(metrics(tmp_path, "ddp", "done")) == 2


def test_diloco_and_sparseloco_single_peers(runs: list[Run], tmp_path: Path) -> None:
    args = ["--steps", "16", *FAST_SWARM]
    # The diloco peer is two processes of one launch: only the main one joins the swarm, the other follows it.
    diloco = launch(
        runs, tmp_path, "diloco", "pretrain.py", "--strategy", "diloco", "--run-id", "d", *args, num_processes=2
    )
    sparse = launch(runs, tmp_path, "sparseloco", "pretrain.py", "--strategy", "sparseloco", "--run-id", "s", *args)
    for run in (diloco, sparse):
        assert run.wait().count("swarm: multiaddr /ip4/127.0.0.1/tcp/") == 1
    dense_rounds = metrics(tmp_path, "diloco", "round")
    topk_rounds = metrics(tmp_path, "sparseloco", "round")
    assert [r["round"] for r in dense_rounds] == [r["round"] for r in topk_rounds] == [0, 1]
    assert all(r["density"] == 1.0 and r["num_peers"] == 1 for r in dense_rounds)
    assert all(0 < r["density"] <= 0.06 for r in topk_rounds)  # topk_density 0.05 in tiny.yaml
    for name in ("diloco", "sparseloco"):
        assert metrics(tmp_path, name, "done")[0]["eval_loss"] < metrics(tmp_path, name, "step")[0]["loss"]


def test_grpo_pulseloco_peers_publish_to_rollout_worker(runs: list[Run], tmp_path: Path) -> None:
    import hivemind

    from pulseloco.cli import main as pulseloco_main

    assert pulseloco_main(["keygen", "--out", str(tmp_path / "publisher")]) == 0
    bootstrap = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        initial_peers = [str(bootstrap.get_visible_maddrs()[0])]
        # 16 warm-up + 16 GRPO steps = 4 rounds of 8; the first peer waits for the second (target group size 2).
        swarm = ["--strategy", "pulseloco", "--run-id", "g", "--initial-peers", *initial_peers]
        swarm += ["--target-group-size", "2", "--matchmaking-time", "60", "--sft-steps", "16", "--steps", "16"]
        peer0 = launch(
            runs, tmp_path, "peer0", "grpo.py", *swarm, "--peer-index", "0", "--linger", "8",
            "--publish", "--signing-key", str(tmp_path / "publisher"),
        )  # fmt: skip
        peer1 = launch(runs, tmp_path, "peer1", "grpo.py", *swarm, "--peer-index", "1", "--linger", "5")
        worker_argv = [sys.executable, str(RECIPES / "rollout_worker.py"), "--config", str(TINY)]
        worker_argv += [
            "--run-id",
            "g",
            "--initial-peers",
            *initial_peers,
            "--public-key",
            str(tmp_path / "publisher.pub"),
        ]
        worker_argv += ["--until-version", "5", "--max-seconds", "200", "--output-dir", str(tmp_path / "worker")]
        worker = Run(worker_argv, tmp_path / "worker.log", tmp_path)
        runs.append(worker)
        worker_log = worker.wait()
        peer0.wait()
        peer1.wait()
    finally:
        bootstrap.shutdown()
    rounds = [metrics(tmp_path, name, "round") for name in ("peer0", "peer1")]
    for peer_rounds in rounds:
        assert [r["round"] for r in peer_rounds] == [0, 1, 2, 3]
        assert all(r["num_peers"] == 2 and r["bytes_sent"] > 0 for r in peer_rounds)
    assert [r["theta_digest"] for r in rounds[0]] == [r["theta_digest"] for r in rounds[1]]
    rewards = [s["reward"] for s in metrics(tmp_path, "peer0", "step") if s["phase"] == "grpo"]
    assert rewards and any(r > 0 for r in rewards)  # the warm-up made rewards non-zero
    published = {p["version"]: p["digest"] for p in metrics(tmp_path, "peer0", "publish")}
    assert max(published) == 5  # the initial model, then one version per round
    rollouts = metrics(tmp_path, "worker", "rollout")
    assert rollouts[-1]["version"] == 5 and rollouts[-1]["digest"] == published[5]
    assert all(0.0 <= r["reward"] <= 1.0 for r in rollouts)
    assert f"digest={published[5]}" in worker_log


BAD_CONFIGURATIONS = [
    (["--strategy", "allreduce"], "unknown strategy 'allreduce' (choose from ddp, diloco, pulseloco, sparseloco)"),
    (["--stepz", "3"], "unknown option --stepz (did you mean --steps?)"),
    (["--model.num-heads", "3"], "model.hidden_size (64) must be divisible by model.num_heads (3)"),
    (["--steps", "ten"], "--steps: expected an integer, got 'ten'"),
    (["--model.hidden-size", "65536", "--model.num-layers", "512", "--model.intermediate-size", "65536"],
     "the model does not fit"),
]  # fmt: skip


def test_bad_configurations_end_with_one_line(runs: list[Run], tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(TINY.read_text().replace("  seq_len: 64", "  seq_lenght: 64"))
    cases = [*BAD_CONFIGURATIONS, (["--config", str(bad_yaml)], "unknown key 'pretrain.seq_lenght'")]
    # Launched together: most fail before importing torch, all fail before training.
    started = []
    for i, (args, expected) in enumerate(cases):
        argv = [sys.executable, str(RECIPES / "pretrain.py"), "--output-dir", str(tmp_path / f"bad{i}"), *args]
        started.append((Run(argv, tmp_path / f"bad{i}.log", tmp_path), expected))
    # An unreachable bootstrap peer, through `accelerate launch -q` (without -q accelerate adds its own traceback).
    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEJcUXx5K5pDjNoaNVZk4W8oFYp9ZdxPPB6ZAWWv1xZKw"
    argv = [*ACCELERATE, "-q", "--num_processes", "1", *LAUNCH_FLAGS, str(RECIPES / "grpo.py"), "--config", str(TINY)]
    argv += ["--strategy", "pulseloco", "--initial-peers", unreachable, "--startup-timeout", "10"]
    argv += ["--output-dir", str(tmp_path / "unreachable")]
    started.append((Run(argv, tmp_path / "unreachable.log", tmp_path), "could not join the swarm"))
    runs.extend(run for run, _ in started)
    for run, expected in started:
        try:
            code = run.proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{run.log.name} did not exit; log:\n{run.text()[-2000:]}") from None
        text = run.text()
        lines = [line for line in text.splitlines() if line.strip()]
        assert code != 0, text
        assert "Traceback" not in text, text
        errors = [line for line in lines if ": error: " in line]
        assert len(errors) == 1 and expected in errors[0], text
        assert errors[0].startswith(("pretrain.py: error: ", "grpo.py: error: ")), text
    assert "--initial-peers" in started[-1][0].text()  # says what to check


@pytest.mark.parametrize("path", sorted((RECIPES / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_config_file_loads(path: Path) -> None:
    sys.path.insert(0, str(RECIPES))
    try:
        import common
    finally:
        sys.path.remove(str(RECIPES))
    config = common.load_config(["--config", str(path)], prog="test", description="", sections=tuple(common.SECTIONS))
    assert config.model.num_parameters(common.ByteTokenizer.vocab_size) > 0
    total = config.grpo.sft_steps + config.grpo.steps
    assert config.pretrain.steps % config.swarm.inner_steps == 0 and total % config.swarm.inner_steps == 0
