"""Recipe smoke tests: real ``accelerate launch`` runs of recipes/ and of a user's TRL script, on 127.0.0.1, from
a tiny warm model in Hugging Face format (``tiny_warm_model`` in tests/conftest.py).

Each test starts its processes at once where they are independent (two CPU cores), waits for them with a
timeout and checks what they wrote. Processes are killed and reaped on failure here and by tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from pulseloco.jsonl import read_json_lines

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
CONFIGS = RECIPES / "configs"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
"""accelerate's launcher: the module ``accelerate launch`` runs, without the console script's import of its other
subcommands (``estimate-memory`` imports transformers' auto classes: 4 CPU-s a launch). One test below runs the
console script itself, as a user types it."""
ACCELERATE_CLI = [str(Path(sys.executable).parent / "accelerate"), "launch"]
SINGLE = ["--config_file", str(RECIPES / "accelerate_configs" / "single_process.yaml")]
TWO_CPU = ["--config_file", str(RECIPES / "accelerate_configs" / "multi_process_cpu.yaml")]
RUN_TIMEOUT_S = 300.0
"""Upper bound for one run (well under a minute each on an idle two-core machine)."""


class Run:
    """A process whose stdout and stderr go to a log file."""

    def __init__(self, argv: Sequence[str], log: Path, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        with log.open("wb") as fh:
            self.proc = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = RUN_TIMEOUT_S, code: int = 0) -> str:
        """Wait for exit code ``code``; returns the log."""
        try:
            returned = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.log.name} did not finish in {timeout:.0f} s:\n{self.text()[-3000:]}") from None
        assert returned == code, f"{self.log.name} exited with {returned}:\n{self.text()[-3000:]}"
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


@pytest.fixture
def bootstrap() -> Iterator[str]:
    """A DHT node on 127.0.0.1 that peers and workers join; yields its multiaddr."""
    import hivemind

    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        yield str(dht.get_visible_maddrs()[0])
    finally:
        dht.shutdown()


def start(runs: list[Run], tmp_path: Path, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Run:
    run = Run(argv, tmp_path / f"{name}.log", tmp_path, env)
    runs.append(run)
    return run


def grpo(model: Path, out: Path, *args: str, launch: Sequence[str] = SINGLE) -> list[str]:
    argv = [*ACCELERATE, *launch, str(RECIPES / "grpo.py"), "--config", str(CONFIGS / "grpo-tiny.yaml")]
    return [*argv, "--model_name_or_path", str(model), "--output_dir", str(out), *args]


def test_grpo_peers_publish_to_rollout_worker(
    runs: list[Run], tmp_path: Path, tiny_warm_model: Path, bootstrap: str
) -> None:
    from pulseloco.cli import main as pulseloco_main

    assert pulseloco_main(["keygen", "--out", str(tmp_path / "publisher")]) == 0
    # 24 steps = 3 rounds of 8; each round waits for both peers (target group size 2).
    swarm = ["--max_steps", "24", "--run_id", "g", "--initial_peers", bootstrap, "--target_group_size", "2"]
    swarm += ["--matchmaking_time", "60", "--num_eval_prompts", "16"]
    publish = ["--publish", "--signing_key", str(tmp_path / "publisher"), "--linger", "15"]
    peer0 = start(runs, tmp_path, "peer0", grpo(tiny_warm_model, tmp_path / "peer0", *swarm, *publish))
    peer1 = start(runs, tmp_path, "peer1", grpo(tiny_warm_model, tmp_path / "peer1", *swarm, "--seed", "1"))
    worker_argv = [sys.executable, str(RECIPES / "rollout_worker.py"), "--model_name_or_path", str(tiny_warm_model)]
    worker_argv += ["--run_id", "g", "--initial_peers", bootstrap, "--public_key", str(tmp_path / "publisher.pub")]
    worker_argv += ["--until_version", "4", "--max_seconds", "240", "--output_dir", str(tmp_path / "worker")]
    worker_argv += ["--num_prompts", "16", "--interval", "0.3"]
    worker = start(runs, tmp_path, "worker", worker_argv)
    worker_log = worker.wait()
    peer0_log, peer1_log = peer0.wait(), peer1.wait()
    for log in (peer0_log, peer1_log):  # recipes/accelerate_configs/single_process.yaml names every value
        assert "were not passed to `accelerate launch`" not in log, log[-3000:]

    rounds = [read_json_lines(tmp_path / name / "pulseloco_rounds.jsonl") for name in ("peer0", "peer1")]
    for peer_rounds in rounds:
        assert [r["round"] for r in peer_rounds] == [0, 1, 2]
        assert all(r["num_peers"] == 2 and r["bytes_sent"] > 0 for r in peer_rounds)
    assert [r["theta_digest"] for r in rounds[0]] == [r["theta_digest"] for r in rounds[1]]
    assert any(r["num_sent"] > 0 for r in rounds[0])  # GRPO moved some weights visibly

    published = {p["version"]: p["digest"] for p in read_json_lines(tmp_path / "peer0" / "pulsesync_versions.jsonl")}
    assert sorted(published) == [1, 2, 3, 4]  # the starting weights, then one version per round
    rollouts = read_json_lines(tmp_path / "worker" / "rollouts.jsonl")
    # version 1 is the checkpoint the worker loaded: taken without a download (its digest is the signed one)
    assert rollouts[0]["path"] == "local" and rollouts[0]["bytes_received"] == 0 and rollouts[-1]["version"] == 4
    for record in rollouts:
        assert record["digest"] == published[record["version"]]
        assert 0.0 <= record["reward"] <= 1.0
    assert f"digest={published[4]}" in worker_log

    # TRL's own logs and the recipe's before/after evaluation; the saved model is a model_name_or_path again.
    history = json.loads((tmp_path / "peer0" / "trainer_state.json").read_text())["log_history"]
    assert any("reward" in entry for entry in history)
    # report_to tensorboard (the config's): the rounds and versions beside TRL's reward, in <output_dir>/tensorboard
    from tensorboard_helpers import scalars

    series = scalars(tmp_path / "peer0" / "tensorboard")
    assert [step for step, _ in series["train/reward"]] == [8, 16, 24]  # logging_steps 8
    assert series["train/pulseloco/bytes_sent"] == [(8 * (r["round"] + 1), r["bytes_sent"]) for r in rounds[0]]
    assert [value for _, value in series["train/pulseloco/num_contributors"]] == [2, 2, 2]
    assert [value for _, value in series["train/pulsesync/version"]][-1] == 4
    evaluation = json.loads((tmp_path / "peer0" / "grpo_eval.json").read_text())
    assert 0.0 <= evaluation["reward_before"] <= 1.0 and 0.0 <= evaluation["reward_after"] <= 1.0
    assert evaluation["seconds"] > 0 and evaluation["cpu_seconds"] > 0  # training's wall and CPU seconds
    assert evaluation["num_eval_samples"] == 8 and evaluation["eval_temperature"] == 1.0  # the defaults
    for when in ("before", "after"):
        assert 0.0 <= evaluation[f"sampled_reward_{when}"] <= 1.0 and 0.0 <= evaluation[f"sampled_se_{when}"] < 0.1
    assert "greedy_reward" in peer0_log and "sampled_reward" in peer0_log
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tmp_path / "peer0")
    AutoTokenizer.from_pretrained(tmp_path / "peer0")


def test_two_lines_make_a_users_trl_script_a_pulseloco_peer(
    runs: list[Run], tmp_path: Path, tiny_warm_model: Path, bootstrap: str
) -> None:
    """The README's change to a TRL script, applied verbatim: an import and a ``callbacks=`` argument."""
    source = (Path(__file__).parent / "assets" / "trl_grpo_script.py").read_text()
    plain = "trainer = GRPOTrainer(model=model_dir, reward_funcs=reward_digits, args=args, train_dataset=dataset)"
    assert plain in source
    changed = source.replace("import sys\n", "import sys\n\nfrom pulseloco.integrations import PulseLoCoCallback\n")
    changed = changed.replace(
        plain,
        plain[:-1] + f', callbacks=[PulseLoCoCallback(run_id="my-run", initial_peers=["{bootstrap}"])])',
    )
    script = tmp_path / "user_grpo.py"
    script.write_text(changed)
    launch = [*ACCELERATE, *SINGLE, str(script), str(tiny_warm_model)]
    # As on a machine without vLLM (the script does not use it; TRL would import it, seconds of CPU per process)
    path = os.pathsep.join(
        filter(None, [str(Path(__file__).parent / "assets" / "without_vllm"), os.environ.get("PYTHONPATH")])
    )
    env = {"PYTHONPATH": path}
    peers = [start(runs, tmp_path, f"user{i}", [*launch, str(tmp_path / f"u{i}"), str(i)], env) for i in range(2)]
    for peer in peers:
        assert "pulseloco: peer_id=" in peer.wait()
    # One outer round after 8 steps: different seeds, different samples, the same consensus weights.
    from safetensors.torch import load_file

    first, second = (load_file(tmp_path / f"u{i}" / "model.safetensors") for i in range(2))
    original = load_file(tiny_warm_model / "model.safetensors")
    assert first.keys() == second.keys()
    assert all((first[k] == second[k]).all() for k in first)
    assert any(not (first[k] == original[k]).all() for k in first)


def test_grpo_sparseloco_and_budgeted_2bit_pulse_peers(
    runs: list[Run], tmp_path: Path, tiny_warm_model: Path, bootstrap: str
) -> None:
    """``--strategy sparseloco`` and ``--strategy pulseloco --pulse_values quantized --pulse_budget 64``, two
    peers each (both pairs at once, each its own run): every round both peers end on one theta, each sends at most
    k entries per tile, and the quantized payload is about a byte an entry."""
    pairs = {
        "sparse": ["--strategy", "sparseloco"],
        "budget": ["--strategy", "pulseloco", "--pulse_values", "quantized", "--pulse_budget", "64"],
    }
    started = []
    for name, flags in pairs.items():
        swarm = ["--max_steps", "16", "--run_id", name, "--initial_peers", bootstrap, "--target_group_size", "2"]
        swarm += ["--matchmaking_time", "60", "--num_eval_prompts", "8", "--num_eval_samples", "1", *flags]
        for i in range(2):
            out = tmp_path / f"{name}{i}"
            started.append(
                (out, start(runs, tmp_path, f"{name}{i}", grpo(tiny_warm_model, out, *swarm, "--seed", str(i))))
            )
    for _, run in started:
        run.wait()
    for name in pairs:
        rounds = [read_json_lines(tmp_path / f"{name}{i}" / "pulseloco_rounds.jsonl") for i in range(2)]
        assert [r["theta_digest"] for r in rounds[0]] == [r["theta_digest"] for r in rounds[1]]
        for record in rounds[0] + rounds[1]:
            assert record["num_peers"] == 2 and record["complete"] and record["bytes_sent"] > 0
            assert 0 < record["density"] <= 0.02  # at most 64 of 4096 per tile (1/64 a row of a vector)
            assert record["payload_bytes"] < 1.2 * record["num_sent"] + 4096  # 2-bit values and coded indices


def test_grpo_ddp_two_processes(runs: list[Run], tmp_path: Path, tiny_warm_model: Path) -> None:
    """``--strategy ddp``: the Trainer's own data parallelism across the two processes of one launch."""
    out = tmp_path / "ddp"
    argv = grpo(
        tiny_warm_model, out, "--strategy", "ddp", "--max_steps", "4", "--num_eval_prompts", "8", launch=TWO_CPU
    )
    log = start(runs, tmp_path, "ddp", argv).wait()
    assert "processes=2" in log
    assert not (out / "pulseloco_rounds.jsonl").exists()
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # only the main process writes
    # A second run into the same directory is refused instead of mixing two runs (the recipe's entry point in this
    # process: test_bad_configurations_end_with_one_line checks how a ConfigError reaches the user).
    from pulseloco.errors import ConfigError

    with pytest.raises(ConfigError, match="already holds a run"):
        _grpo_module().main(grpo(tiny_warm_model, out)[len(ACCELERATE) + 3 :])


def _not_a_causal_lm(tmp_path: Path) -> Path:
    from transformers import DistilBertConfig

    path = tmp_path / "distilbert"
    DistilBertConfig(dim=16, n_layers=1, n_heads=2, hidden_dim=32).save_pretrained(path)
    return path


def _too_big(tmp_path: Path, warm: Path) -> Path:
    """A config (no weights needed) of a model far larger than this machine's memory, with a tokenizer."""
    from transformers import AutoConfig

    path = tmp_path / "huge"
    shutil.copytree(warm, path)
    config = AutoConfig.from_pretrained(warm)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 8192, 28672, 200
    config.save_pretrained(path)
    return path


def _grpo_module() -> Any:
    """pulseloco/recipes/grpo.py (its ``main`` raises what the script prints as one line)."""
    from pulseloco.recipes import grpo

    return grpo


def test_help_lists_config_then_pulseloco_then_each_library_dataclass(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` of a recipe: a one-line usage, ``--config`` first, pulseloco's groups next, then each library
    dataclass under its class name (argparse alone printed a 244-line usage and every option in one list)."""
    from pulseloco.recipes import grpo

    with pytest.raises(SystemExit) as caught:
        grpo.main(["--help"])
    assert caught.value.code == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == "usage: grpo.py [--config FILE] [--OPTION VALUE ...]"
    titles = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert titles[:3] == [
        "config file",
        "pulseloco: the swarm, PULSELoCo's rounds and PULSESync",
        "pulseloco: rollouts from the swarm's workers and their checks",
    ], titles
    assert titles[3:] == ["task", "GRPOConfig (trl)", "ModelConfig (trl)", "options"], titles
    # the groups hold the options: the swarm's under pulseloco's, TRL's own under GRPOConfig's
    assert text.index("--initial_peers") < text.index("pulseloco: rollouts") < text.index("--num_generations")


def test_bad_configurations_are_refused_with_one_line(tmp_path: Path, tiny_warm_model: Path) -> None:
    """Each bad input raises the recipe's ConfigError (printed as one line by ``common.run_recipe``) before any
    training or swarm traffic; test_bad_configurations_end_with_one_line below checks the printing."""
    from pulseloco.errors import ConfigError

    grpo_module = _grpo_module()
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_warm_model, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text((CONFIGS / "grpo-tiny.yaml").read_text().replace("max_steps: 64", "max_stepz: 64"))
    warm = ["--model_name_or_path", str(tiny_warm_model)]
    cases = [
        (["--max_stepz", "3", *warm], "unknown option(s)"),
        (["--max_steps", "ten", *warm], "invalid int value: 'ten'"),
        (["--max_steps", "12", *warm], "max_steps (12) must be a multiple of inner_steps (8)"),
        (["--publish", *warm], "--publish needs --signing_key"),
        (["--model_name_or_path", str(tmp_path / "missing")], "does not exist"),
        (["--model_name_or_path", str(_not_a_causal_lm(tmp_path))], "not a causal language model"),
        (["--model_name_or_path", str(no_tokenizer)], "has no usable tokenizer"),
        (["--model_name_or_path", str(_too_big(tmp_path, tiny_warm_model))], "does not fit"),
        ([], "--model_name_or_path is required"),
        (["--config", str(bad_yaml), *warm], "max_stepz"),
    ]
    for i, (args, expected) in enumerate(cases):
        out = tmp_path / f"bad{i}"
        argv = ["--output_dir", str(out)]
        if "--config" not in args:
            argv += ["--config", str(CONFIGS / "grpo-tiny.yaml")]
        with pytest.raises(ConfigError) as caught:
            grpo_module.main([*argv, *args])
        message = str(caught.value)
        assert expected in message and "\n" not in message, (args, message)
        assert not out.exists(), args  # refused before anything was written


def test_bad_configurations_end_with_one_line(
    runs: list[Run], tmp_path: Path, tiny_warm_model: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """As a user sees it: through `accelerate launch -q` (a real launch of the console script), and through
    ``common.run_recipe`` as the script's ``run`` calls it (in this process: tests/recipe_helpers.py), the
    recipe's one line and no traceback (the launcher's included)."""
    from recipe_helpers import run_in_process

    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEJcUXx5K5pDjNoaNVZk4W8oFYp9ZdxPPB6ZAWWv1xZKw"
    argv = grpo(tiny_warm_model, tmp_path / "unreachable", "--initial_peers", unreachable, "--startup_timeout", "4")
    argv[: len(ACCELERATE)] = [*ACCELERATE_CLI, "-q"]
    launched = start(runs, tmp_path, "unreachable", argv)  # runs while the case below runs here
    bad = ["--output_dir", str(tmp_path / "bad"), "--config", str(CONFIGS / "grpo-tiny.yaml")]
    bad += ["--strategy", "allreduce", "--model_name_or_path", str(tiny_warm_model)]
    result = run_in_process(capfd, "grpo.py", lambda: _grpo_module().main(bad))
    assert result.returncode == 2, result.stderr  # a bad configuration
    outputs = [(result.stdout + result.stderr, "unknown strategy 'allreduce' (choose from ddp, diloco, pulseloco")]
    try:
        launched.proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the launch did not exit:\n{launched.text()[-2000:]}") from None
    assert launched.proc.returncode == 1, launched.text()  # accelerate exits 1
    outputs.append((launched.text(), "could not join the swarm"))
    for text, expected in outputs:
        lines = [line for line in text.splitlines() if line.strip()]
        assert "Traceback" not in text, text
        errors = [line for line in lines if ": error: " in line]
        assert len(errors) == 1 and expected in errors[0], text
        assert errors[0].startswith("grpo.py: error: "), text
    assert "--initial-peers" in launched.text()  # says what to check
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("grpo*.yaml")), ids=lambda p: p.stem)
def test_every_grpo_config_parses(path: Path) -> None:
    import torch
    from trl import GRPOConfig, ModelConfig

    from pulseloco.integrations.args import PulseLoCoArguments
    from pulseloco.recipes import common
    from pulseloco.recipes import grpo as recipe

    argv = ["--config", str(path)]
    if not torch.cuda.is_available():  # GPU configs train in bf16, which TrainingArguments refuses without a GPU
        argv += ["--use_cpu", "true", "--bf16", "false"]
    task, training, _, pulse = common.parse_args(
        (recipe.TaskArguments, GRPOConfig, ModelConfig, PulseLoCoArguments), argv, "test"
    )
    assert training.max_steps % pulse.inner_steps == 0
    assert task.num_eval_prompts >= 1


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--engine", "onnx"], "engine must be one of transformers, vllm, got 'onnx'"),
        (["--compute_dtype", "float16"], "compute_dtype must be auto, bfloat16 or float32, got 'float16'"),
        (["--compare_full_reload"], "--compare_full_reload needs --engine vllm"),
        (["--interval", "0"], "interval must be positive, got 0.0"),
        (["--max_queue", "0"], "max_queue must be at least 1, got 0"),
        ([], "--public_key is required"),
    ],
)
def test_rollout_worker_refuses_bad_options_with_one_line(args: list[str], expected: str) -> None:
    """The worker's option checks raise the recipe's one-line ConfigError before anything loads."""
    from pulseloco.errors import ConfigError
    from pulseloco.recipes import rollout_worker

    peer = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEJcUXx5K5pDjNoaNVZk4W8oFYp9ZdxPPB6ZAWWv1xZKw"  # never dialled
    argv = ["--model_name_or_path", "unused", "--initial_peers", peer, *args]
    if args:
        argv += ["--public_key", "unused.pub"]
    with pytest.raises(ConfigError) as caught:
        rollout_worker.main(argv)
    assert expected in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_rollout_worker_says_what_it_waits_for(
    tmp_path: Path, tiny_warm_model: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A worker whose run never publishes names the run id and what must run, then gives up at max_seconds. The
    worker's command line runs in this process (tests/recipe_helpers.py, which puts back the SIGINT and SIGTERM
    handlers it replaces), where a process would spend its first seconds importing torch, transformers and hivemind;
    test_grpo_peers_publish_to_rollout_worker above runs a worker process."""
    from recipe_helpers import run_in_process

    from pulseloco.cli import main as pulseloco_main
    from pulseloco.recipes import rollout_worker

    assert pulseloco_main(["keygen", "--out", str(tmp_path / "k")]) == 0
    import hivemind

    sigterm = signal.getsignal(signal.SIGTERM)
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        argv = ["--model_name_or_path", str(tiny_warm_model)]
        argv += ["--run_id", "nobody", "--initial_peers", str(dht.get_visible_maddrs()[0])]
        argv += ["--public_key", str(tmp_path / "k.pub"), "--wait_warning", "2", "--max_seconds", "6"]
        argv += ["--until_version", "1", "--output_dir", str(tmp_path / "w")]
        started = time.monotonic()
        result = run_in_process(capfd, "rollout_worker.py", lambda: rollout_worker.main(argv))
    finally:
        dht.shutdown()
    text = result.stdout + result.stderr
    assert signal.getsignal(signal.SIGTERM) is sigterm  # the worker's handler did not outlive its run
    assert result.returncode == 1, text[-3000:]  # a run-time failure (VersionTimeoutError)
    assert time.monotonic() - started < 120
    assert re.search(r"no version of run_id=nobody\.policy after 2 s; check that a trainer in the swarm", text)
    assert "a recipe with --publish --run_id nobody, or a script with PulseSyncCallback" in text
    assert "no version of run 'nobody.policy'" not in text  # one message for one wait, not the subscriber's too
    assert "rollout_worker.py: error: version 1 did not arrive" in text


def test_a_trainer_process_that_does_not_use_vllm_never_imports_it() -> None:
    """TRL imports vLLM whenever it is installed (about 6 s of CPU per process: ``trl.import_utils``'s
    ``is_vllm_available`` guards its imports); ``pulseloco.integrations.skip_vllm_import`` makes TRL see it as
    missing, so a recipe process whose TRL ``use_vllm`` is off never loads it, and TRL's trainer (with the swarm's
    importance-sampling path, ``swarm_rollouts``) still imports. One process, in the recipe's order: TRL first
    (before the call it sees vLLM, when installed), then the call, then the trainer."""
    import importlib.util

    check = "print('available', is_vllm_available()); "
    probe = "import sys; from trl.import_utils import is_vllm_available; " + check
    probe += "from pulseloco.integrations import skip_vllm_import; skip_vllm_import(); " + check
    probe += "import trl.trainer.grpo_trainer, pulseloco.integrations.swarm_rollouts; "
    probe += "print('vllm loaded' if sys.modules.get('vllm') is not None else 'vllm not loaded')"
    installed = importlib.util.find_spec("vllm") is not None  # without the call TRL sees it (and would import it)
    expected = [f"available {installed}", "available False", "vllm not loaded"]
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-3:] == expected, result.stdout[-2000:]


def test_sampled_reward_by_hand_on_the_tiny_warm_model(tiny_warm_model: Path) -> None:
    """The held-out sampled reward of grpo_eval.json: its mean and standard error recomputed from the same draws,
    the draws keyed by the seed alone, and the global torch random state left as it was."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pulseloco.recipes import grpo, tasks
    from pulseloco.rollouts.engines.hf import TransformersEngine

    engine = TransformersEngine(
        AutoModelForCausalLM.from_pretrained(tiny_warm_model), AutoTokenizer.from_pretrained(tiny_warm_model)
    )
    spec = tasks.spec_for_model(str(tiny_warm_model), None, None)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    mean, se = grpo.sampled_reward(engine, spec, 16, 4, temperature=1.0, samples=4, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert grpo.sampled_reward(engine, spec, 16, 4, temperature=1.0, samples=4, seed=7) == (mean, se)

    problems = tasks.eval_problems(spec, 16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        texts = engine.generate([p for p, _ in problems for _ in range(4)], max_new_tokens=4, temperature=1.0)
    rewards = [float(text == answer) for text, (_, answer) in zip(texts, [p for p in problems for _ in range(4)])]
    per_problem = [sum(rewards[4 * i : 4 * i + 4]) / 4 for i in range(16)]
    assert mean == sum(rewards) / 64
    assert se == math.sqrt(sum(p * (1 - p) for p in per_problem) / 3) / 16
    assert 0 < mean < 1 and se > 0  # the tiny warm model answers some problems, not all, when sampling
    one, one_se = grpo.sampled_reward(engine, spec, 16, 4, temperature=1.0, samples=1, seed=7)
    assert one_se == math.sqrt(one * (1 - one) / 16)
    with pytest.raises(ValueError, match="samples >= 1 and temperature > 0"):
        grpo.sampled_reward(engine, spec, 16, 4, temperature=0.0, samples=4, seed=7)
