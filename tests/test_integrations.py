"""PulseLoCoCallback and PulseSyncCallback on a plain ``transformers.Trainer``, in this process, with a real DHT.

The GRPOTrainer path through ``accelerate launch`` (two peers and a rollout worker) is in tests/test_recipes.py.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from datasets import Dataset
from tensorboard_helpers import scalars
from transformers import Trainer, TrainingArguments

from pulseloco.errors import ConfigError
from pulseloco.integrations import PulseLoCoCallback, PulseSyncCallback
from pulseloco.integrations.trainer import STATE_FILE
from pulseloco.jsonl import read_json_lines
from pulseloco.loco import AveragingConfig, RoundConfig
from pulseloco.models import random_causal_lm
from pulseloco.swarm import SwarmConfig

LONE_PEER = {"averaging_config": AveragingConfig(target_group_size=1, matchmaking_time=2.0, request_timeout=5.0)}
"""A peer alone in its swarm: each round's group forms at once."""


def tiny_model() -> Any:
    """A config-built Llama (random init): enough for the callback's bookkeeping."""
    return random_causal_lm(
        "llama", seed=0, vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip


def token_dataset(num: int = 64, length: int = 12) -> Dataset:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (num, length), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def training_args(output_dir: Path, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": 8,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_cpu": True,
        "seed": 0,
        "logging_steps": 1,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def train(output_dir: Path, callbacks: list[Any], resume: str | None = None, **overrides: Any) -> Trainer:
    model = tiny_model()
    trainer = Trainer(
        model=model, args=training_args(output_dir, **overrides), train_dataset=token_dataset(), callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_inner_steps_count_optimizer_steps_under_gradient_accumulation(tmp_path: Path, overlap: bool) -> None:
    """With ``overlap`` the last round lands when training ends (the callback's ``finish``)."""
    callback = PulseLoCoCallback(
        run_id="accum",
        round_config=RoundConfig(inner_steps=4, overlap=overlap),
        metrics_path=tmp_path / "rounds.jsonl",
        **LONE_PEER,
    )
    trainer = train(tmp_path / "out", [callback], max_steps=8, gradient_accumulation_steps=3)
    assert trainer.state.global_step == 8
    assert callback.loco is not None and callback.loco.round == 2 and callback.loco.local_step == 0
    recorded = read_json_lines(tmp_path / "rounds.jsonl")
    assert [r["round"] for r in recorded] == [0, 1]
    assert all(r["num_peers"] == 1 and r["density"] > 0 for r in recorded)
    # The model holds theta (cast to its dtype) after the last round.
    flat = torch.cat([p.detach().reshape(-1).float() for p in trainer.model.parameters()])
    assert torch.equal(flat, callback.loco.theta_N)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_resume_from_a_mid_round_checkpoint_continues_the_same_trajectory(tmp_path: Path, overlap: bool) -> None:
    # Run A: 12 steps, H = 4, checkpoints at 6 (mid-round; with overlap, round 0 in flight) and 12.
    rounds = RoundConfig(inner_steps=4, overlap=overlap)
    first = PulseLoCoCallback(run_id="resume-a", round_config=rounds, **LONE_PEER)
    a = train(tmp_path / "a", [first], max_steps=12, save_strategy="steps", save_steps=6)
    assert (tmp_path / "a" / "checkpoint-6" / STATE_FILE).is_file()
    # Run B resumes A's step-6 checkpoint in a fresh Trainer and callback.
    shutil.copytree(tmp_path / "a" / "checkpoint-6", tmp_path / "b" / "checkpoint-6")
    second = PulseLoCoCallback(run_id="resume-b", round_config=rounds, **LONE_PEER)
    b = train(tmp_path / "b", [second], resume=str(tmp_path / "b" / "checkpoint-6"), max_steps=12)
    assert first.loco is not None and second.loco is not None
    assert second.loco.round == first.loco.round == 3
    assert torch.equal(second.loco.theta_N, first.loco.theta_N)
    assert torch.equal(second.loco.residual_N, first.loco.residual_N)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_resume_without_pulseloco_state_is_refused(tmp_path: Path) -> None:
    train(tmp_path / "plain", [], max_steps=4, save_strategy="steps", save_steps=4)
    callback = PulseLoCoCallback(run_id="no-state", round_config=RoundConfig(inner_steps=4), **LONE_PEER)
    with pytest.raises(ConfigError, match=f"{STATE_FILE} does not exist"):
        train(tmp_path / "plain", [callback], resume=str(tmp_path / "plain" / "checkpoint-4"), max_steps=8)
    callback.close()


def test_a_run_that_would_not_end_on_a_round_boundary_is_refused_before_joining(tmp_path: Path) -> None:
    """The two-line callback checks what the recipes check: the last 2 of 6 steps would never be averaged."""
    callback = PulseLoCoCallback(run_id="ragged", round_config=RoundConfig(inner_steps=4), **LONE_PEER)
    with pytest.raises(ConfigError, match=r"max_steps \(6\) must be a multiple of inner_steps \(4\)"):
        train(tmp_path / "out", [callback], max_steps=6)
    assert callback.loco is None and callback.dht is None  # refused before the swarm was joined
    callback.close()


def test_pulsesync_every_round_publishes_each_consensus_version(tmp_path: Path) -> None:
    from pulseloco.cli import main as pulseloco_main
    from pulseloco.sync.signing import load_public_key
    from pulseloco.sync.subscriber import Subscriber

    assert pulseloco_main(["keygen", "--out", str(tmp_path / "key")]) == 0
    loco = PulseLoCoCallback(run_id="sync", round_config=RoundConfig(inner_steps=2), **LONE_PEER)
    sync = PulseSyncCallback(signing_key=str(tmp_path / "key"), metrics_path=tmp_path / "versions.jsonl")
    announced: list[tuple[int, str, bool]] = []
    sync.add_announce_listener(lambda v: announced.append((v.version, v.digest, v.announced)))
    # PulseSyncCallback first: it must find the PulseLoCoCallback whatever the order.
    trainer = train(tmp_path / "out", [sync, loco], max_steps=6)
    published = read_json_lines(tmp_path / "versions.jsonl")
    assert [p["version"] for p in published] == [1, 2, 3, 4]  # the start, then one per round
    # the announce listeners see each version as its JSON line says; one added later gets the last at once
    assert announced == [(p["version"], p["digest"], p["announced"]) for p in published]
    late: list[int] = []
    sync.add_announce_listener(lambda v: late.append(v.version))
    assert late == [4]
    # The last version is the consensus model, bit for bit in BF16.
    follower = Subscriber.from_directory(tmp_path / "out" / "versions", load_public_key(tmp_path / "key.pub"))
    state: dict[str, torch.Tensor] = {}
    follower.update(state)
    assert follower.version == 4 and follower.digest == published[-1]["digest"]
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name


@pytest.mark.parametrize("sync_first", [True, False])
def test_pulsesync_every_step_with_pulseloco_publishes_local_steps_and_each_consensus(
    tmp_path: Path, sync_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """every=1 beside PULSELoCo: a version per optimizer step, and the one of a round's last step is the consensus
    after the outer step (not the peer's pre-averaging weights), whichever callback runs first."""
    from pulseloco.cli import main as pulseloco_main
    from pulseloco.sync.signing import load_public_key
    from pulseloco.sync.subscriber import Subscriber

    assert pulseloco_main(["keygen", "--out", str(tmp_path / "key")]) == 0
    loco = PulseLoCoCallback(run_id="sync-steps", round_config=RoundConfig(inner_steps=3), **LONE_PEER)
    sync = PulseSyncCallback(every=1, signing_key=str(tmp_path / "key"), metrics_path=tmp_path / "versions.jsonl")
    with caplog.at_level(logging.INFO, logger="pulseloco.integrations"):
        trainer = train(tmp_path / "out", [sync, loco] if sync_first else [loco, sync], max_steps=6)
    queued = [r.getMessage() for r in caplog.records if r.getMessage().startswith("queued version=")]
    reasons = [(int(m.split()[1].split("=")[1]), m.split("reason=")[1]) for m in queued]
    # the start, then one per step: the local weights between rounds, the consensus after each round's last step
    assert reasons == [(1, "start"), (2, "step"), (3, "step"), (4, "round"), (5, "step"), (6, "step"), (7, "round")]
    published = read_json_lines(tmp_path / "versions.jsonl")
    assert published[-1]["version"] == 7  # a queued version may be superseded by the next before it is stored
    follower = Subscriber.from_directory(tmp_path / "out" / "versions", load_public_key(tmp_path / "key.pub"))
    state: dict[str, torch.Tensor] = {}
    follower.update(state)
    assert follower.version == 7 and follower.digest == published[-1]["digest"]
    assert loco.loco is not None and loco.loco.round == 2
    for name, tensor in trainer.model.state_dict().items():  # the consensus: the model holds theta after a round
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name


def test_pulsesync_every_round_without_pulseloco_says_what_to_do(tmp_path: Path) -> None:
    from pulseloco.cli import main as pulseloco_main

    assert pulseloco_main(["keygen", "--out", str(tmp_path / "key")]) == 0
    sync = PulseSyncCallback(signing_key=str(tmp_path / "key"))
    with pytest.raises(ConfigError, match="every=N"):
        train(tmp_path / "out", [sync], max_steps=2)


def test_bad_callback_arguments() -> None:
    with pytest.raises(ConfigError, match="not both"):
        PulseLoCoCallback(swarm=SwarmConfig(), initial_peers=[])
    with pytest.raises(ConfigError, match="linger"):
        PulseLoCoCallback(linger=-1.0)
    with pytest.raises(ConfigError, match="run_id"):
        PulseLoCoCallback(run_id="two words")
    with pytest.raises(ConfigError, match="every"):
        PulseSyncCallback(every="epoch")


def test_pulse_values_option_reaches_the_selector_and_is_validated() -> None:
    from pulseloco.integrations.args import PulseLoCoArguments

    callback = PulseLoCoArguments(pulse_values="bfloat16").callbacks()[0]
    assert callback.round_config.pulse_values == "bfloat16"
    with pytest.raises(ConfigError, match="pulse_values must be one of float32, bfloat16, quantized"):
        PulseLoCoArguments(pulse_values="fp8")
    with pytest.raises(ConfigError, match="need --strategy pulseloco"):
        PulseLoCoArguments(strategy="diloco", pulse_values="bfloat16")
    with pytest.raises(ConfigError, match="need --strategy pulseloco"):
        PulseLoCoArguments(strategy="sparseloco", pulse_budget=64)
    sparse = PulseLoCoArguments(strategy="sparseloco", topk_k=128).round_config()
    assert sparse.selector == "sparseloco" and sparse.topk_k == 128
    assert (sparse.resolved("outer_lr"), sparse.resolved("outer_momentum"), sparse.resolved("error_decay")) == (
        1.0,
        0.0,
        0.95,
    )


# -- metrics in the Trainer's logs (report_to) ----------------------------------------------------------------


def test_callbacks_run_before_the_reporting_integrations_both_ways(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trainer(callbacks=[...]) and trainer.add_callback(...) both put the callbacks after TensorBoardCallback;
    each moves itself before it at its first event, so its numbers are in the very logs TensorBoard writes."""
    from transformers.integrations import TensorBoardCallback

    from pulseloco.cli import main as pulseloco_main
    from pulseloco.integrations.callback_base import LogsContributor

    assert pulseloco_main(["keygen", "--out", str(tmp_path / "key")]) == 0
    loco = PulseLoCoCallback(run_id="order", round_config=RoundConfig(inner_steps=2), **LONE_PEER)
    sync = PulseSyncCallback(signing_key=str(tmp_path / "key"))
    args = training_args(tmp_path / "out", max_steps=2, report_to=["tensorboard"])
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=token_dataset(), callbacks=[loco])

    def position(callback: Any) -> int:
        return next(i for i, cb in enumerate(trainer.callback_handler.callbacks) if cb is callback)

    def tensorboard() -> int:
        return next(i for i, cb in enumerate(trainer.callback_handler.callbacks) if isinstance(cb, TensorBoardCallback))

    assert position(loco) < tensorboard()  # moved at on_init_end
    trainer.add_callback(sync)
    assert position(sync) > tensorboard()  # as transformers adds it
    others_before = [cb for cb in trainer.callback_handler.callbacks if not isinstance(cb, LogsContributor)]
    trainer.train()
    assert position(loco) < position(sync) < tensorboard()  # sync moved at on_train_begin, after loco
    # every other callback kept its order
    assert [cb for cb in trainer.callback_handler.callbacks if not isinstance(cb, LogsContributor)] == others_before
    series = scalars(tmp_path / "out")
    assert [step for step, _ in series["train/pulseloco/round"]] == [2]
    assert [value for _, value in series["train/pulsesync/version"]][-1] == 2  # the start, then round 0
    record = next(r for r in trainer.state.log_history if "loss" in r and r["step"] == 2)
    assert record["pulseloco/round"] == 0 and record["pulseloco/num_peers"] == 1  # trainer_state.json too

    # Called other than through a CallbackHandler, it says why its numbers may not reach report_to.
    stray = PulseLoCoCallback(run_id="stray")
    with caplog.at_level(logging.WARNING, logger="pulseloco.integrations"):
        stray._run_before_log_readers(warn=True)
        stray._run_before_log_readers(warn=True)
    assert sum("could not find the transformers CallbackHandler" in r.getMessage() for r in caplog.records) == 1


def test_two_peers_log_rounds_and_versions_to_tensorboard(tmp_path: Path) -> None:
    """Two Trainer peers (threads of this process, each with its own DHT on 127.0.0.1) with report_to
    tensorboard: the event files hold train/pulseloco/* and train/pulsesync/* next to train/loss, equal to the
    peers' own JSON-lines records."""
    import threading

    import hivemind

    from pulseloco.cli import main as pulseloco_main

    assert pulseloco_main(["keygen", "--out", str(tmp_path / "key")]) == 0
    averaging = AveragingConfig(target_group_size=2, matchmaking_time=10.0, request_timeout=5.0, averaging_timeout=20.0)
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    maddrs = [str(a) for a in first.get_visible_maddrs()]
    second = hivemind.DHT(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    trainers: list[Trainer] = []
    try:
        for index, dht in enumerate((first, second)):
            out = tmp_path / f"peer{index}"
            callbacks: list[Any] = [
                PulseLoCoCallback(
                    dht=dht,
                    run_id="tb",
                    round_config=RoundConfig(inner_steps=2),
                    metrics_path=out / "rounds.jsonl",
                    averaging_config=averaging,
                )
            ]
            if index == 0:
                callbacks.append(
                    PulseSyncCallback(signing_key=str(tmp_path / "key"), metrics_path=out / "versions.jsonl")
                )
            args = training_args(out, max_steps=4, report_to=["tensorboard"], seed=index)
            trainers.append(Trainer(model=tiny_model(), args=args, train_dataset=token_dataset(), callbacks=callbacks))
        errors: list[BaseException] = []

        def run(trainer: Trainer) -> None:
            try:
                trainer.train()
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads) and not errors, errors
    finally:
        second.shutdown()
        first.shutdown()

    for index in range(2):
        series = scalars(tmp_path / f"peer{index}")
        recorded = read_json_lines(tmp_path / f"peer{index}" / "rounds.jsonl")
        assert [r["round"] for r in recorded] == [0, 1]
        assert [s for s, _ in series["train/loss"]] == [1, 2, 3, 4]
        # logging_steps=1: each round in the log of the step that ended it, its values as recorded
        assert series["train/pulseloco/round"] == [(2, 0.0), (4, 1.0)]
        for name in ("bytes_sent", "bytes_received", "num_peers", "num_contributors", "density", "seconds_sync"):
            logged = [value for _, value in series[f"train/pulseloco/{name}"]]
            assert logged == pytest.approx([r[name] for r in recorded], rel=1e-6), name
        assert sum(v for _, v in series["train/pulseloco/bytes_sent"]) == sum(r["bytes_sent"] for r in recorded) > 0
        assert [v for _, v in series["train/pulseloco/num_contributors"]] == [2.0, 2.0]  # both peers, every round
        assert [v for _, v in series["train/pulseloco/repaired"]] == [0.0, 0.0]
    publisher = scalars(tmp_path / "peer0")
    published = read_json_lines(tmp_path / "peer0" / "versions.jsonl")
    assert [p["version"] for p in published] == [1, 2, 3]  # the start, then one per round
    versions = [value for _, value in publisher["train/pulsesync/version"]]
    assert versions == sorted(set(versions)) and versions[-1] == 3  # increasing; the last flushed into the last log
    assert sum(v for _, v in publisher["train/pulsesync/num_versions"]) == 3  # each version logged once
    assert sum(v for _, v in publisher["train/pulsesync/patch_bytes"]) == sum(p["patch_bytes"] for p in published)
    assert all(0 < v < 60 for _, v in publisher["train/pulsesync/seconds_publish"])
    assert all(p["announced"] and p["seconds_publish"] > 0 for p in published)
    assert not any(tag.startswith("train/pulsesync/") for tag in scalars(tmp_path / "peer1"))


def test_random_causal_lm_is_the_same_model_for_a_seed_and_refuses_unknown_types() -> None:
    sizes = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    a = random_causal_lm("qwen2", seed=3, num_attention_heads=2, num_key_value_heads=1, **sizes)
    b = random_causal_lm("qwen2", seed=3, num_attention_heads=2, num_key_value_heads=1, **sizes)
    c = random_causal_lm("qwen2", seed=4, num_attention_heads=2, num_key_value_heads=1, **sizes)
    assert type(a).__name__ == "Qwen2ForCausalLM" and a.config.hidden_size == 16
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    with pytest.raises(ConfigError, match="unknown model type 'no-such-arch'"):
        random_causal_lm("no-such-arch")
