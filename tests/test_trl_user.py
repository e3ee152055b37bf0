"""The TRL user's path, as the README tells it: a GRPO script of the user's own (their model, their reward) with
``PulseSyncCallback`` and ``SwarmRollouts`` as TRL's ``rollout_func``, and a rollout worker started with
``python recipes/rollout_worker.py --serve_rollouts ...``.

The end-to-end test writes such a script into ``tmp_path`` and runs it as a process beside a real worker process,
both joining a bootstrap DHT node of the test: one run id given once, the metrics files in ``output_dir`` by
default, the last version reaching the worker before the trainer leaves, TRL's importance-sampling metric in the
logs, and TRL's warnings at most once each. The small tests check the run-id rules, the fallback's worker command
and the wrong-key message one by one."""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rollout_helpers import save_tiny_model
from sync_helpers import maddrs, start_dht

from pulseloco.errors import ConfigError
from pulseloco.jsonl import read_json_lines

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240.0

USER_SCRIPT = """
import json
import sys

from pulseloco.integrations import PulseSyncCallback, SwarmRollouts, skip_vllm_import
from pulseloco.integrations.swarm_rollouts import RolloutConfig
from pulseloco.swarm import SwarmConfig

skip_vllm_import()  # the README's line: TRL's own vLLM generation is not used here

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

model_dir, signing_key, bootstrap, output_dir = sys.argv[1:5]


def reward_digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in completion)) for completion in completions]


args = GRPOConfig(
    output_dir=output_dir, max_steps=2, per_device_train_batch_size=8, num_generations=4,
    max_completion_length=6, temperature=1.0, learning_rate=1e-3, beta=0.0, logging_steps=1,
    use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
)
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir),
    processing_class=AutoTokenizer.from_pretrained(model_dir),
    reward_funcs=reward_digits,
    args=args,
    train_dataset=Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(32)]),
    callbacks=[PulseSyncCallback(signing_key=signing_key, every=1,
                                 swarm=SwarmConfig(initial_peers=[bootstrap]))],
    rollout_func=SwarmRollouts(run_id="my-run", config=RolloutConfig(rollout_timeout=120)),
)
trainer.train()
trainer.save_state()
"""
"""The README's script without PULSELoCo: PulseSyncCallback takes its run id from SwarmRollouts' and joins the
bootstrap peer with ``swarm=SwarmConfig(initial_peers=[...])``; the worker runs with ``--run_id my-run``."""


def _popen(argv: list[str], log: Path, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRL_EXPERIMENTAL_SILENCE", None)  # the warning as a user sees it
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    procs.append(proc)
    return proc


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def keypair(tmp_path: Path) -> Path:
    from pulseloco.cli import main as pulseloco_main

    path = tmp_path / "keys" / "publisher"
    assert pulseloco_main(["keygen", "--out", str(path)]) == 0
    return path


@pytest.mark.timeout(300)
def test_a_users_grpo_script_with_pulsesync_and_swarm_rollouts_keeps_the_readme_promises(
    tmp_path: Path, keypair: Path
) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny-llama")
    script = tmp_path / "my_grpo.py"
    script.write_text(USER_SCRIPT)
    out, worker_out = tmp_path / "run", tmp_path / "worker"
    node = start_dht()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        bootstrap = maddrs(node)[0]
        worker_argv = [sys.executable, "recipes/rollout_worker.py", "--serve_rollouts", "--run_id", "my-run"]
        worker_argv += ["--initial_peers", bootstrap, "--model_name_or_path", str(model_dir)]
        worker_argv += ["--public_key", f"{keypair}.pub", "--output_dir", str(worker_out), "--interval", "0.2"]
        worker_argv += ["--max_seconds", str(TIMEOUT_S), "--lease_max_new_tokens", "16"]
        worker = _popen(worker_argv, tmp_path / "worker.log", procs)
        trainer = _popen(
            [sys.executable, str(script), str(model_dir), str(keypair), bootstrap, str(out)],
            tmp_path / "trainer.log",
            procs,
        )
        try:
            code = trainer.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        log = (tmp_path / "trainer.log").read_text(errors="replace")
        assert code == 0, log[-4000:]
    finally:
        _stop(procs)
        node.shutdown()
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")
    assert worker.returncode is not None

    # 2. one run id: the callback took SwarmRollouts' and published where the worker follows; no local fallback
    assert "pulsesync: publishing run_id=my-run.policy" in log, log[-4000:]
    assert "generating this round locally" not in log, log[-4000:]
    # 1. rollouts.jsonl and the versions file in output_dir, with no metrics_path given
    rounds = read_json_lines(out / "rollouts.jsonl")
    assert [r["round"] for r in rounds] == [1, 2], rounds
    peer = worker_log.split("rollout: serving leases peer_id=")[1].split()[0]
    assert all(r["local"] is False and r["workers"] == [peer] for r in rounds), rounds
    published = read_json_lines(out / "pulsesync_versions.jsonl")
    last = published[-1]["version"]
    assert last == 3, published  # the start, then one per step (every=1, 2 steps)
    # 5. the last version reached the worker before the trainer left
    served = [r["version"] for r in read_json_lines(worker_out / "rollouts.jsonl")]
    assert last in served, (served, worker_log[-3000:])
    assert "could not reach version" not in worker_log
    # 7. TRL's importance-sampling correction, in the logs
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    ratios = [
        e["sampling/importance_sampling_ratio/mean"] for e in history if "sampling/importance_sampling_ratio/mean" in e
    ]
    assert len(ratios) == 2 and all(0.5 < r < 2.0 for r in ratios), history
    assert all("sampling/sampling_logp_difference/mean" in e for e in history if "loss" in e), history
    # 8. TRL's two warnings at most once each, and our reason once; with skip_vllm_import no vLLM is imported, so
    # neither its version warning nor its Triton line
    assert "TRL currently supports vLLM versions" not in log and "Triton" not in log, log[-6000:]
    assert "You are using 'rollout_func'" not in log, log[-6000:]  # TRL's two lines, said in one
    assert log.count("pulseloco: SwarmRollouts is TRL's rollout_func, which TRL marks experimental") == 1, log[-6000:]


# -- 2. one run id ------------------------------------------------------------------------------------------------


def test_run_ids_are_bare_training_run_ids() -> None:
    from pulseloco.integrations import PulseSyncCallback, SwarmRollouts

    for make in (lambda: PulseSyncCallback(run_id="X.policy", every=1), lambda: SwarmRollouts(run_id="X.policy")):
        with pytest.raises(ConfigError, match="give run_id='X'"):
            make()
    with pytest.raises(ConfigError, match="run_id must be"):
        SwarmRollouts(run_id="two words")
    assert PulseSyncCallback(run_id="X", every=1).run_id == "X"


@pytest.mark.parametrize(
    "max_lag, queued, newest, steps_ahead, expected",
    [
        (2, 10, None, 1, 9),  # a round sent ahead is trained at version 11 at most: 2 behind it
        (2, 10, None, 0, 8),  # a round asked for now: at 10
        (1, 10, None, 1, 10),
        (0, 10, None, 1, 10),  # never a version not queued yet (a version every few steps: a long wait)
        (2, None, 7, 1, 6),  # a trainer that does not publish counts from the newest it read
        (2, None, None, 1, 0),  # none known: any version
        (5, 2, None, 1, 0),
    ],
)
def test_a_rounds_oldest_usable_version(
    max_lag: int, queued: int | None, newest: int | None, steps_ahead: int, expected: int
) -> None:
    from pulseloco.integrations import SwarmRollouts
    from pulseloco.integrations.swarm_rollouts import RolloutConfig

    rollouts = SwarmRollouts(run_id="min-version", config=RolloutConfig(max_lag=max_lag))
    rollouts.client = SimpleNamespace(newest=newest)  # type: ignore[assignment]
    rollouts._publishers = [SimpleNamespace(queued_version=queued)] if queued is not None else []  # type: ignore[list-item]
    assert rollouts._min_version(steps_ahead) == expected


def test_rollouts_and_callbacks_that_disagree_on_the_run_are_refused() -> None:
    from pulseloco.integrations import PulseLoCoCallback, PulseSyncCallback
    from pulseloco.integrations.swarm_rollouts import check_run_ids

    loco = PulseLoCoCallback(run_id="A")
    sync = PulseSyncCallback(run_id="B", every=1)
    with pytest.raises(ConfigError, match=r"SwarmRollouts\(run_id='X'\) and the trainer's PulseLoCoCallback"):
        check_run_ids("X", [loco])
    with pytest.raises(ConfigError, match=r"PulseSyncCallback\(run_id='B'\)"):
        check_run_ids("X", [sync])
    assert check_run_ids(None, [loco]) == "A" and check_run_ids("B", [sync]) == "B"
    with pytest.raises(ConfigError, match="SwarmRollouts needs the training run id"):
        check_run_ids(None, [])
    # the publisher's side, when training begins
    with pytest.raises(ConfigError, match=r"PulseSyncCallback\(run_id='B'\) and the Trainer's PulseLoCoCallback"):
        sync._resolve_run_id(loco)
    with pytest.raises(ConfigError, match="PulseSyncCallback needs the training run id"):
        PulseSyncCallback(every=1)._resolve_run_id(None)


def _tiny_trainer(output_dir: Path, callbacks: list[Any]) -> Any:
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from pulseloco.models import random_causal_lm

    model = random_causal_lm(
        "llama", seed=0, vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1)).tolist()
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, save_strategy="no",
        report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=1,
    )  # fmt: skip
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def test_pulsesync_without_pulseloco_needs_a_run_id_and_writes_its_versions_to_output_dir(
    tmp_path: Path, keypair: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No run id anywhere: refused when training begins, before anything is published. With one (and a bootstrap
    peer to join, as the README shows): the versions file lands in output_dir without metrics_path, and alone in
    its swarm the publisher leaves at once (nobody follows the run to wait for). A rerun into the same output_dir
    says that it goes on from the versions there, and does."""
    from pulseloco.integrations import PulseSyncCallback
    from pulseloco.swarm import SwarmConfig

    with pytest.raises(ConfigError, match="PulseSyncCallback needs the training run id"):
        _tiny_trainer(tmp_path / "none", [PulseSyncCallback(signing_key=str(keypair), every=1)]).train()
    node = start_dht()
    try:
        sync = PulseSyncCallback(
            signing_key=str(keypair), run_id="solo", every=1, swarm=SwarmConfig(initial_peers=maddrs(node))
        )
        _tiny_trainer(tmp_path / "solo", [sync]).train()
    finally:
        node.shutdown()
    assert sync.training_run_id == "solo"
    first = [r["version"] for r in read_json_lines(tmp_path / "solo" / "pulsesync_versions.jsonl")]
    assert first[-1] == 3
    assert "already holds" not in capsys.readouterr().out
    # a rerun into the same output_dir says that it goes on from the versions there, and does
    again = PulseSyncCallback(signing_key=str(keypair), run_id="solo", every=1, wait_for_copy=0)
    _tiny_trainer(tmp_path / "solo", [again]).train()
    assert "already holds versions up to 3 of an earlier run; this run publishes from version 4" in (
        capsys.readouterr().out
    )
    # its lines appended, its versions numbered on from 4 (the starting weights, then one per step: 4, 5, 6, of which
    # the publisher may skip one superseded while queued, as it may in the first run: [1, 3] in CI once)
    again_versions = [r["version"] for r in read_json_lines(tmp_path / "solo" / "pulsesync_versions.jsonl")]
    assert again_versions[: len(first)] == first and again_versions[-1] == 6, again_versions
    assert all(4 <= v <= 6 for v in again_versions[len(first) :]), again_versions
    off = PulseSyncCallback(signing_key=str(keypair), run_id="off", every=1, metrics_path=False, wait_for_copy=0)
    _tiny_trainer(tmp_path / "off", [off]).train()
    assert not (tmp_path / "off" / "pulsesync_versions.jsonl").exists()
    with pytest.raises(ConfigError, match="wait_for_copy"):
        PulseSyncCallback(every=1, wait_for_copy=-1)


def test_sampling_settings_the_checks_cannot_replay_stop_training_at_its_start(tmp_path: Path, keypair: Path) -> None:
    """TRL's ``top_p`` below 1 with swarm rollouts: the README's PulseSyncCallback refuses it at train begin, with
    the setting to change, before any step or rollout round (SwarmRollouts alone would at its first round)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from pulseloco.integrations import PulseSyncCallback, SwarmRollouts

    model_dir = save_tiny_model(tmp_path / "m")
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, top_p=0.9, use_cpu=True, report_to="none", save_strategy="no",
    )  # fmt: skip
    rollouts = SwarmRollouts(run_id="my-run")
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "1+1="}] * 8),
        callbacks=[PulseSyncCallback(signing_key=str(keypair), wait_for_copy=0)],
        rollout_func=rollouts,
    )
    with pytest.raises(ConfigError, match=r"plain temperature.*top_p=0\.9") as caught:
        trainer.train()
    assert any(entry.name == "on_train_begin" for entry in caught.traceback)  # at train begin, not a round
    assert trainer.state.global_step == 0 and rollouts.client is None


# -- 4. the fallback's worker command -----------------------------------------------------------------------------


def test_the_fallbacks_worker_command_parses_with_the_workers_parser(tmp_path: Path, keypair: Path) -> None:
    """The command the fallback prints, as printed by a client with no worker in its swarm, is a complete worker
    command line: the worker's own parser takes it (it would exit 2 otherwise); so does one with every value known
    (what SwarmRollouts passes: the trainer's model directory and key file)."""
    from pulseloco.recipes import rollout_worker
    from pulseloco.rollouts.client import LeaseConfig, NoWorkersError, RolloutClient, worker_command
    from pulseloco.sync.signing import load_public_key

    node = start_dht()
    try:
        client = RolloutClient(
            node, "alone.policy", load_public_key(f"{keypair}.pub"), vocab_size=64,
            config=LeaseConfig(rollout_timeout=1),
        )  # fmt: skip
        try:
            with pytest.raises(NoWorkersError) as caught:
                client.submit([[1, 2, 3]], num_samples=2, max_new_tokens=4, temperature=1.0).result(timeout=60)
        finally:
            client.close()
        bootstrap = maddrs(node)[0]
    finally:
        node.shutdown()
    printed = str(caught.value).split("start one with `")[1].split("`")[0]
    full = worker_command("my-run", model="/models/my model", public_key=f"{keypair}.pub", initial_peers=bootstrap)
    for hint in (printed, full):
        argv = shlex.split(hint)
        assert argv[:3] == ["python", "recipes/rollout_worker.py", "--serve_rollouts"], hint
        args, swarm = rollout_worker.parse_arguments(argv[2:])  # raises ConfigError (exit 2) if incomplete
        assert args.serve_rollouts and swarm.initial_peers, hint
    assert swarm.policy_run_id == "my-run.policy" and args.model_name_or_path == "/models/my model"
    assert "--run_id alone" in printed
    with pytest.raises(ConfigError, match="--model_name_or_path is required"):
        rollout_worker.parse_arguments(["--serve_rollouts", "--run_id", "x", "--initial_peers", bootstrap])


# -- 6. a worker with the wrong public key --------------------------------------------------------------------


class _Record:
    def __init__(self, value: bytes) -> None:
        self.value = value


class _Future:
    def __init__(self, value: bytes) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> _Record:
        return _Record(self.value)


class _HeadDHT:
    """A DHT whose every lookup answers one head record."""

    def __init__(self, record: bytes) -> None:
        self.record = record

    def get(self, key: str, latest: bool = False, return_future: bool = False) -> _Future:
        return _Future(self.record)


def test_a_wrong_public_key_is_said_once_at_once_naming_the_key_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import time

    from pulseloco.sync.signing import Envelope, generate_key, load_public_key, save_keypair, sign_envelope
    from pulseloco.sync.transport import read_head

    publisher, stranger = generate_key(), generate_key()
    _, wrong_pub = save_keypair(stranger, tmp_path / "wrong")
    head = Envelope("run-w.policy", "head", 3, None, "0" * 32, "", "", 0, anchor_version=1, time=time.time())
    dht = _HeadDHT(sign_envelope(publisher, head))
    key = load_public_key(wrong_pub)
    with caplog.at_level(logging.DEBUG, logger="pulseloco.sync"):
        for _ in range(5):  # a reader polls every few seconds
            assert read_head(dht, "run-w.policy", key) is None  # type: ignore[arg-type]
    said = [r for r in caplog.records if "fails verification" in r.getMessage()]
    loud = [r for r in said if r.levelno >= logging.WARNING]
    assert len(said) == 5 and len(loud) == 1 and loud[0].levelno == logging.ERROR, [r.getMessage() for r in said]
    message = loud[0].getMessage()
    assert str(wrong_pub) in message and "pulseloco keygen" in message and ".pub" in message, message
