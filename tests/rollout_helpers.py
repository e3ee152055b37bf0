"""Helpers for the rollout-loop tests (tests/test_rollouts.py): a tiny model directory, rollout worker processes
(honest, slow, stale or rogue), and a reference for the workers' sampling log-probabilities.

Everything is real: the model is a randomly initialized ``transformers`` Llama saved with ``save_pretrained`` beside
the recipes' byte-level tokenizer (no download, seconds to build), the workers are ``spawn`` processes with their
own hivemind DHT on 127.0.0.1, a :class:`pulseloco.sync.subscriber.Subscriber` following the publisher, a
:class:`pulseloco.rollouts.engines.hf.TransformersEngine` in BF16 and a
:class:`pulseloco.rollouts.worker.RolloutServer`, exactly as ``recipes/rollout_worker.py --serve_rollouts`` sets
them up. A worker can be told to misbehave (:data:`MODES`) by wrapping its engine or the reply encoding of its
real server, so a rogue speaks the real protocol on the real handler.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from sync_helpers import _serve_requests, _worker_logging, start_dht

TINY_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    initializer_range=0.2,
)
"""A Llama small enough that a lease of a few dozen completions takes a fraction of a second on one CPU thread. The
large ``initializer_range`` makes its next-token distributions depend visibly on the context, so that a completion
scored under another prompt than its own gets other log-probabilities."""

MODES = (
    "honest",
    "slow",
    "vocab",
    "digest",
    "version",
    "envelope",
    "forged",
    "oversize",
    "garbage",
    "other_weights",
    "forged_logprobs",
    "cherry_pick",
    "inject",
    "replay",
    "truncate",
    "steer",
    "forged_within",
)
"""How a worker answers leases: ``honest``; ``slow`` (honest, after ``delay`` seconds per lease); ``vocab`` (token
ids beyond the vocabulary); ``digest`` (claims a digest that is not the published one); ``version`` (claims a
version that was never published, with no envelope); ``envelope`` (the same claim with the publisher's genuine
envelope of the version it holds); ``forged`` (the same claim with an envelope of that version signed by another
key); ``oversize`` (completions longer than the lease allows: a payload above the reader's bound); ``garbage`` (a
reply header that is not JSON).

The dishonest workers whose replies pass every check of the protocol (the published version and digest, well-formed
ids and log-probabilities) and that only the trainer's replay of the sampler catches: ``other_weights`` (samples,
with the lease's seed and the replayable rule, from other weights: the served ones plus noise, while claiming the
published digest); ``forged_logprobs`` (honest tokens, log-probabilities lowered by 1.5 times its precision's
per-token tolerance: beyond what any engine's rounding explains); ``cherry_pick`` (samples four completions per
prompt with seeds of its own and returns the most likely one, with its true log-probabilities); ``inject`` (a fixed
text, `` 42`` and EOS, with its true log-probabilities under the served weights); ``replay`` (answers with the
completions it made for the last lease it served before, under that lease's seed, claiming the version it serves
now); ``truncate`` (honest completions cut
to half their length without an end-of-sequence token).

And those that aim just inside the check's tolerances (:mod:`pulseloco.rollouts.tolerances`, the worker's
precision): ``steer`` (at every position, of the tokens whose perturbed score trails the sampler's choice by less
than 95% of the margin, the one with the lowest id: a worker that picks its tokens where the margin lets it, with
their true log-probabilities; :func:`steering.steer`); ``forged_within`` (honest tokens, every
log-probability lowered by 90% of the per-token tolerance)."""

LEASE_MAX_NEW_TOKENS = 64


def byte_tokenizer() -> Any:
    """The recipes' byte-level tokenizer (pulseloco/recipes/pretrain.py): one token per byte, then EOS and PAD."""
    from pulseloco.recipes import pretrain

    return pretrain.byte_level_tokenizer(TINY_LLAMA["max_position_embeddings"])


def save_tiny_model(path: Path, seed: int = 0) -> Path:
    """A random-init tiny Llama with the byte-level tokenizer, saved as a Hugging Face model directory (what
    ``--model_name_or_path`` takes)."""
    from pulseloco.models import random_causal_lm

    tokenizer = byte_tokenizer()
    model = random_causal_lm(
        "llama",
        seed=seed,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **TINY_LLAMA,
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> list[float]:
    """Each completion token's log-probability under ``softmax(logits / temperature)`` given the prompt and the
    completion before it (teacher forcing, one unpadded sequence)."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(completion) - 1].float()
    logprobs = (logits / temperature).log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def lowest_id(row: int, ids: list[int], close: list[int]) -> int:
    """A steering worker's pick (:func:`steering.steer`): the lowest token id of those close enough."""
    return min(close)


# ---- the worker process ----------------------------------------------------------------------------------------


class _Behaviour:
    """Stands where the server's engine is: generates with the real engine, then answers as ``mode`` says."""

    def __init__(self, engine: Any, vocab_size: int) -> None:
        self.engine = engine
        self.compute_dtype = engine.compute_dtype
        self.vocab_size = vocab_size
        self.mode = "honest"
        self.delay = 0.0
        self.started = 0
        self.before: list[Any] | None = None
        self.other: Any = None

    def generate_ids(
        self,
        prompt_ids: Any,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
        sequences: Any = None,
    ) -> Any:
        from pulseloco.rollouts.engines.hf import Completion

        self.started += 1
        if self.mode == "slow":
            time.sleep(self.delay)
        options = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, sequences=sequences)
        if self.mode in ("other_weights", "cherry_pick", "inject"):
            return self._dishonest(prompt_ids, **options)
        if self.mode == "steer":
            from steering import steer

            from pulseloco.rollouts.tolerances import TOLERANCES

            aim = 0.95 * TOLERANCES[self.compute_dtype].margin
            eos = self.engine.tokenizer.eos_token_id
            return steer(self.engine.model, prompt_ids, aim=aim, choose=lowest_id, eos=eos, **options)
        completions = self.engine.generate_ids(prompt_ids, **options)
        if self.mode != "replay" or self.before is None:
            self.before = completions
        if self.mode == "replay":  # what it made for its last lease before, cycled to this lease's size
            old = [self.before[i % len(self.before)] for i in range(len(completions))]
            return [Completion(c.token_ids[:max_new_tokens], c.logprobs[:max_new_tokens]) for c in old]
        if self.mode == "forged_logprobs":
            from pulseloco.rollouts.tolerances import TOLERANCES

            lower = 1.5 * TOLERANCES[self.compute_dtype].logprob_error
            return [Completion(c.token_ids, [lp - lower for lp in c.logprobs]) for c in completions]
        if self.mode == "forged_within":
            from pulseloco.rollouts.tolerances import TOLERANCES

            lower = 0.9 * TOLERANCES[self.compute_dtype].logprob_error
            return [Completion(c.token_ids, [lp - lower for lp in c.logprobs]) for c in completions]
        if self.mode == "truncate":
            eos = self.engine.tokenizer.eos_token_id
            cut = [c.token_ids[: max(1, len(c.token_ids) // 2)] for c in completions]
            return [
                Completion(ids[:-1] if ids[-1] == eos and len(ids) > 1 else ids, c.logprobs[: len(ids)])
                for ids, c in zip(cut, completions)
            ]
        if self.mode == "vocab":
            return [Completion([self.vocab_size + 7] * len(c.token_ids), c.logprobs) for c in completions]
        if self.mode == "oversize":
            length = 3 * max_new_tokens
            return [Completion([1] * length, [-1.0] * length) for _ in completions]
        return completions

    def _dishonest(
        self, prompt_ids: Any, *, max_new_tokens: int, temperature: float, seed: int | None, sequences: Any
    ) -> Any:
        from pulseloco.rollouts.engines.hf import Completion, TransformersEngine

        engine = self.engine
        if self.mode == "other_weights":
            if self.other is None:  # the served weights plus noise: what a worker with a fine-tuned copy holds
                import copy

                model = copy.deepcopy(engine.model)
                gen = torch.Generator().manual_seed(99)
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(torch.randn(param.shape, generator=gen).to(param.dtype) * 0.05)
                self.other = TransformersEngine(model, engine.tokenizer, shadow=False)
            return self.other.generate_ids(
                prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, sequences=sequences
            )
        if self.mode == "cherry_pick":
            candidates = [
                engine.generate_ids(
                    prompt_ids,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    seed=1000 + k,
                    sequences=sequences,
                )
                for k in range(4)
            ]
            return [max(options, key=lambda c: sum(c.logprobs)) for options in zip(*candidates)]
        text = [int(b) for b in b" 42"] + [engine.tokenizer.eos_token_id]
        text = text[-max_new_tokens:]
        out = []
        for prompt in prompt_ids:  # the text's true log-probabilities under the served weights
            out.append(Completion(text, reference_logprobs(engine.model, list(prompt), text, temperature)))
        return out


def rollout_worker(conn: Any, run_id: str, public_pem: bytes, model_dir: str, options: dict) -> None:
    """A rollout worker in its own process, driven over ``conn`` (:class:`sync_helpers.WorkerProcess`).

    Requests:

    - ``start(initial_peers)`` -> peer id (the model is loaded before, so that the process can be spawned while the
      swarm it joins is still starting);
    - ``update(version)``: follow the publisher until the engine serves ``version`` (``weights_updated`` and then
      ``server.weights_loaded``, as recipes/rollout_worker.py does) -> the served version and digest;
    - ``mode(name, delay)``: how to answer leases from now on (:data:`MODES`);
    - ``boast()``: announce a throughput of 10**9 tokens/s from now on (records are unsigned hints: a rogue claims
      to be fast to draw leases; trainers rank workers by the rates they measured, :func:`lease_order`);
    - ``stats`` -> the server's counters and the leases the engine started;
    - ``close``.

    ``options`` go to :class:`RolloutServer`, but for ``dtype`` (default ``bfloat16``): what the engine computes in
    (``float32``: on the same BF16 values, as ``rollout_worker.py``'s default).
    """
    _worker_logging()
    torch.set_num_threads(1)
    import pulseloco.rollouts.worker as worker_module
    from pulseloco.rollouts.engines.hf import TransformersEngine
    from pulseloco.rollouts.worker import RolloutServer
    from pulseloco.sync.signing import Envelope, generate_key, load_public_key, sign_envelope
    from pulseloco.sync.subscriber import Subscriber

    options = dict(options)
    engine = TransformersEngine.from_pretrained(model_dir, dtype=getattr(torch, options.pop("dtype", "bfloat16")))
    vocab_size = max(len(engine.tokenizer), int(engine.model.config.vocab_size))
    behaviour = _Behaviour(engine, vocab_size)
    state: dict[str, Any] = {}

    real_encode = worker_module.encode_reply
    real_stream = worker_module.stream_messages

    stranger = generate_key()

    def encode_reply(
        lease: Any, version: int, digest: str, completions: Any, seconds: float, envelope: bytes = b"", **kwargs: Any
    ) -> Any:
        if behaviour.mode == "digest":
            digest = "0" * len(digest)
        if behaviour.mode in ("version", "envelope", "forged"):
            version += 1000
        if behaviour.mode == "version":
            envelope = b""
        if behaviour.mode == "forged":
            fields = Envelope(run_id, "patch", version, version - 1, digest, digest, "0" * 64, 1)
            envelope = sign_envelope(stranger, fields)
        return real_encode(lease, version, digest, completions, seconds, envelope, **kwargs)

    def stream_messages(message_type: Any, header: dict, payload: Any = (), **kwargs: Any) -> Any:
        if behaviour.mode == "garbage" and header.get("status") == "ok":
            yield message_type(metadata=b"\x00{not json")
            return
        yield from real_stream(message_type, header, payload, **kwargs)

    worker_module.encode_reply = encode_reply
    worker_module.stream_messages = stream_messages

    def start(initial_peers: list[str]) -> str:
        state["dht"] = start_dht(initial_peers)
        state["sub"] = Subscriber(state["dht"], run_id, load_public_key(public_pem), timeout=30)
        server_options = {"max_new_tokens": LEASE_MAX_NEW_TOKENS, "announce_every": 1.0, **options}
        state["server"] = RolloutServer(
            state["dht"],
            run_id,
            behaviour,
            state["sub"],
            engine_name="transformers",
            vocab_size=vocab_size,
            **server_options,
        )
        return state["server"].peer_id

    def update(version: int, timeout: float = 60.0) -> dict:
        sub, server = state["sub"], state["server"]
        deadline = time.monotonic() + timeout
        while server.version != version:
            report = sub.update_report(engine.weights())
            if report is not None:
                engine.weights_updated(report.changed, version=report.version)
                server.weights_loaded(report.version, report.digest)
            elif time.monotonic() > deadline:
                raise TimeoutError(f"version {version} did not arrive in {timeout:.0f} s (holding {sub.version})")
            else:
                time.sleep(0.05)
        return {"version": server.version, "digest": sub.digest}

    def mode(name: str, delay: float = 0.0) -> None:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r}")
        behaviour.mode, behaviour.delay = name, delay

    def boast() -> None:
        server = state["server"]
        server._note_throughput = lambda tokens_per_s, samples_per_s: None
        server.tokens_per_s, server.samples_per_s = 1e9, 1e9
        server.announce()

    def stats() -> dict:
        server = state["server"]
        return {
            "served": server.num_served,
            "refused": server.num_refused,
            "expired": server.num_expired,
            "started": behaviour.started,
            "version": server.version,
            "pushed": state["sub"].num_pushed,
        }

    def close() -> None:
        if "server" in state:
            state["server"].close()
        if "sub" in state:
            state["sub"].close()
            state["dht"].shutdown()

    _serve_requests(
        conn, {"start": start, "update": update, "mode": mode, "boast": boast, "stats": stats, "close": close}
    )
