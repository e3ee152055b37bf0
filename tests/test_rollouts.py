"""The rollout loop: lease and reply checks, workers on a real swarm, and GRPO trainers fed by them.

1. The protocol (:mod:`pulseloco.rollouts.protocol`), pure: every malformed lease, reply and worker record is
   refused with a reason, and good ones round-trip exactly.
2. A real swarm on 127.0.0.1 (one module-wide DHT and :class:`Publisher` in this process, two rollout worker
   processes built as recipes/rollout_worker.py --serve_rollouts builds them, tests/rollout_helpers.py): a
   :class:`RolloutClient` here runs batches on them, with one worker honest, slow and then killed, stale, or rogue.
   The honest replies are checked against the published versions and digests and, token by token, against the
   published weights' sampling log-probabilities for the group's own prompt.
3. The recipes as users run them: ``recipes/grpo.py --rollouts swarm`` alone (falls back to local generation), with
   bad flags (exit 2, one line), and fed by one ``recipes/rollout_worker.py --serve_rollouts``.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from hivemind.utils import get_dht_time
from rollout_helpers import reference_logprobs, rollout_worker, save_tiny_model
from sync_helpers import WorkerProcess, bf16_digest, close_all, maddrs, start_dht, wait_for

from pulseloco.errors import PayloadError, PayloadSizeError
from pulseloco.jsonl import read_json_lines
from pulseloco.keys import workers_key
from pulseloco.rollouts.client import LeaseConfig, NoWorkersError, RolloutClient, lease_order, lease_shares
from pulseloco.rollouts.protocol import (
    LOGPROB_SLACK,
    MAX_LEASE_BYTES,
    MAX_PROMPTS_PER_LEASE,
    Lease,
    WorkerInfo,
    decode_lease,
    decode_reply,
    encode_reply,
    parse_worker_record,
)
from pulseloco.rollouts.version_states import VersionStates
from pulseloco.sync.signing import MAX_ENVELOPE_BYTES

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
CONFIG = RECIPES / "configs" / "grpo-tiny.yaml"
RUN = "rollouts-test"
POLICY = f"{RUN}.policy"
VOCAB = 258
"""The tiny model's vocabulary: 256 bytes, EOS and PAD (tests/rollout_helpers.py)."""


# ================================================================================================================
# 1. the protocol
# ================================================================================================================

PROTO_RUN = "proto.policy"
LIMITS = dict(run_id=PROTO_RUN, vocab_size=VOCAB, max_new_tokens=8, max_prompt_tokens=16)


def lease_blob(**changes: Any) -> bytes:
    raw: dict[str, Any] = dict(
        run_id=PROTO_RUN,
        lease_id="lease-0a",
        prompts=[[1, 2, 3], [4, 5]],
        num_samples=2,
        max_new_tokens=4,
        temperature=1.0,
        seed=7,
        deadline_s=30.0,
        sequences=[0, 2],
    )
    for key, value in changes.items():
        if value is ...:
            del raw[key]
        else:
            raw[key] = value
    return json.dumps(raw).encode()


def test_lease_shares_follow_the_measured_rates() -> None:
    assert lease_shares([], {}) == {}
    assert lease_shares(["a", "b"], {}) == {"a": 0.5, "b": 0.5}  # nothing measured: even
    assert lease_shares(["a", "b"], {"a": 3.0, "b": 1.0}) == {"a": 0.75, "b": 0.25}
    # c is not measured yet: it counts as the median of the measured (2.0); a refused or gone worker's rate is unused
    assert lease_shares(["a", "b", "c"], {"a": 3.0, "b": 1.0, "gone": 100.0}) == {"a": 0.5, "b": 1 / 6, "c": 1 / 3}
    assert lease_shares(["a", "b"], {"a": 0.0, "b": 2.0}) == {"a": 0.5, "b": 0.5}  # no rate counts as unmeasured


def test_leases_go_first_to_the_fastest_measured_worker_not_to_a_claimed_speed() -> None:
    # b is measured fastest; d is not measured yet, so it goes last whatever it announces (a claim is no input)
    rates = {"a": 1.0, "b": 4.0, "c": 2.0}
    assert lease_order(["d", "c", "a", "b"], rates, {}, {}) == ["b", "c", "a", "d"]
    # ties: fewer leases in flight, then a shorter queue; unmeasured workers by the same rule, after the measured
    assert lease_order(["a", "b", "x", "y"], {"a": 1.0, "b": 1.0}, {"a": 1}, {"y": 0, "x": 3}) == ["b", "a", "y", "x"]


def test_a_good_lease_round_trips() -> None:
    lease = decode_lease(lease_blob(), **LIMITS)
    assert lease == Lease(PROTO_RUN, "lease-0a", [[1, 2, 3], [4, 5]], 2, 4, 1.0, 7, 30.0, [0, 2])
    assert decode_lease(lease.encode(), **LIMITS) == lease
    assert lease.num_completions == 4 and lease.min_version == 0  # a lease without the field: any version
    waiting = decode_lease(lease_blob(min_version=5), **LIMITS)
    assert waiting.min_version == 5 and decode_lease(waiting.encode(), **LIMITS) == waiting
    # the limits themselves are allowed
    edge = dict(prompts=[[0] * 16, [VOCAB - 1]], max_new_tokens=8, temperature=10, num_samples=256, seed=2**63 - 1)
    edge["sequences"] = [0, 2**32 - 256]  # the last sample of the last prompt is sequence 2**32 - 1
    assert decode_lease(lease_blob(**edge), **LIMITS).prompts == [[0] * 16, [VOCAB - 1]]


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"run_id": "other.policy"}, "lease for run 'other.policy'"),
        ({"run_id": ...}, "lease for run None"),
        ({"lease_id": ""}, "malformed lease_id"),
        ({"lease_id": "has space"}, "malformed lease_id"),
        ({"lease_id": "x" * 81}, "malformed lease_id"),
        ({"lease_id": 12}, "malformed lease_id"),
        ({"prompts": []}, "prompts must be a list"),
        ({"prompts": "1 2 3"}, "prompts must be a list"),
        ({"prompts": [[1]] * (MAX_PROMPTS_PER_LEASE + 1)}, "prompts must be a list"),
        ({"prompts": [[1, 2], []]}, "each prompt must be a list of 1 to 16"),
        ({"prompts": [[1] * 17]}, "each prompt must be a list of 1 to 16"),
        ({"prompts": [[1, 2], "ab"]}, "each prompt must be a list"),
        ({"prompts": [[1, VOCAB]]}, "prompt token ids must be integers in [0, 258)"),
        ({"prompts": [[-1, 2]]}, "prompt token ids must be integers"),
        ({"prompts": [[1.0, 2]]}, "prompt token ids must be integers"),
        ({"prompts": [[True, 2]]}, "prompt token ids must be integers"),
        ({"num_samples": 0}, "num_samples must be an integer in [1, 256]"),
        ({"num_samples": 257}, "num_samples must be an integer in [1, 256]"),
        ({"num_samples": True}, "num_samples must be an integer"),
        ({"num_samples": "2"}, "num_samples must be an integer"),
        ({"num_samples": ...}, "num_samples must be an integer"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer in [1, 8]"),
        ({"max_new_tokens": 9}, "max_new_tokens must be an integer in [1, 8]"),
        ({"temperature": 0}, "temperature must be in (0.0, 10.0]"),
        ({"temperature": -1.0}, "temperature must be in"),
        ({"temperature": 10.5}, "temperature must be in"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": "1.0"}, "temperature must be a finite number"),
        ({"temperature": True}, "temperature must be a finite number"),
        ({"seed": -1}, "seed must be an integer"),
        ({"seed": 2**63}, "seed must be an integer"),
        ({"sequences": ...}, "sequences must be one integer in [0, 4294967294] per prompt (2)"),
        ({"sequences": [0]}, "sequences must be one integer"),
        ({"sequences": [0, -1]}, "sequences must be one integer"),
        ({"sequences": [0, 2**32 - 1]}, "sequences must be one integer"),  # its second sample would be 2**32
        ({"sequences": [0, 1.0]}, "sequences must be one integer"),
        ({"sequences": [0, True]}, "sequences must be one integer"),
        ({"sequences": "0 2"}, "sequences must be one integer"),
        ({"deadline_s": 0}, "deadline_s must be in"),
        ({"deadline_s": 1e6}, "deadline_s must be in"),
        ({"min_version": -1}, "min_version must be an integer"),
        ({"min_version": True}, "min_version must be an integer"),
        ({"min_version": "3"}, "min_version must be an integer"),
        ({"min_version": 2**63}, "min_version must be an integer"),
    ],
)
def test_decode_lease_refuses(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(PayloadError) as caught:
        decode_lease(lease_blob(**changes), **LIMITS)
    assert reason in str(caught.value)


@pytest.mark.parametrize(
    "blob, reason",
    [
        (b"", "lease is not JSON"),
        (b"\xff\xfe", "lease is not JSON"),
        (b"{not json", "lease is not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "lease is not JSON"),
        (b"[1, 2]", "lease must be a JSON object"),
        (b'"a string"', "lease must be a JSON object"),
    ],
)
def test_decode_lease_refuses_what_is_not_a_json_object(blob: bytes, reason: str) -> None:
    with pytest.raises(PayloadError) as caught:
        decode_lease(blob, **LIMITS)
    assert reason in str(caught.value)


def test_decode_lease_refuses_oversized_requests_before_parsing() -> None:
    good = lease_blob()
    padded = good[:-1] + b" " * (MAX_LEASE_BYTES - len(good)) + b"}"
    assert len(padded) == MAX_LEASE_BYTES
    assert decode_lease(padded, **LIMITS).lease_id == "lease-0a"  # exactly at the limit: fine
    with pytest.raises(PayloadSizeError, match="above the limit"):
        decode_lease(padded[:-1] + b" }", **LIMITS)
    with pytest.raises(PayloadSizeError):
        decode_lease(b"x" * (MAX_LEASE_BYTES + 1), **LIMITS)  # refused on its size, not as bad JSON


# ---- replies ---------------------------------------------------------------------------------------------------

REPLY_LEASE = Lease(PROTO_RUN, "lease-0b", [[10, 11, 12], [13, 14]], 2, 4, 1.0, 3, 30.0, [0, 2])
COMPLETIONS = [
    ([1, 2, 3, 4], [-0.5, -1.25, -2.0, -0.125]),
    ([256], [-3.0]),
    ([5, 6], [-0.25, 0.0]),
    ([257, 7, 8], [-1.5, -4.0, -0.75]),
]
DIGEST = "0123456789abcdef" * 2


ENVELOPE = b'{"fields": {"version": 5}, "sig": "..."}'
"""Carried as opaque bytes (base64 in the header); the client verifies it (see the rogue worker tests)."""


def good_reply() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header of an honest reply to :data:`REPLY_LEASE` and its payload's three arrays (to corrupt one)."""
    header, buffers = encode_reply(REPLY_LEASE, 5, DIGEST, COMPLETIONS, 0.25, ENVELOPE, compute_dtype="float32")
    parts = {
        "prompts": np.frombuffer(buffers[0], dtype="<i4").copy(),
        "tokens": np.frombuffer(buffers[1], dtype="<i4").copy(),
        "logprobs": np.frombuffer(buffers[2], dtype="<f4").copy(),
    }
    return {**header.to_json(), "size": sum(len(b) for b in buffers)}, parts


def payload(parts: dict[str, np.ndarray]) -> bytes:
    return parts["prompts"].tobytes() + parts["tokens"].tobytes() + parts["logprobs"].tobytes()


def test_a_good_reply_round_trips_exactly() -> None:
    header, parts = good_reply()
    assert header["status"] == "ok" and header["lease_id"] == "lease-0b"
    assert header["prompt_lengths"] == [3, 2] and header["completion_lengths"] == [4, 1, 2, 3]
    assert header["size"] == len(payload(parts)) == 4 * 5 + 8 * 10
    samples = decode_reply(REPLY_LEASE, json.loads(json.dumps(header)), payload(parts), vocab_size=VOCAB)
    assert (samples.version, samples.digest, samples.seconds, samples.envelope) == (5, DIGEST, 0.25, ENVELOPE)
    assert samples.compute_dtype == "float32"
    assert samples.completion_ids == [[[1, 2, 3, 4], [256]], [[5, 6], [257, 7, 8]]]
    assert samples.logprobs == [[[-0.5, -1.25, -2.0, -0.125], [-3.0]], [[-0.25, 0.0], [-1.5, -4.0, -0.75]]]


def _set(key: str, value: Any):
    def corrupt(header: dict[str, Any], parts: dict[str, np.ndarray]) -> None:
        header[key] = value

    return corrupt


def _poke(part: str, index: int, value: float):
    def corrupt(header: dict[str, Any], parts: dict[str, np.ndarray]) -> None:
        parts[part][index] = value

    return corrupt


def _lengths(key: str, lengths: list[int]):
    return _set(key, lengths)


def _resize(delta: int):
    def corrupt(header: dict[str, Any], parts: dict[str, np.ndarray]) -> None:
        if delta > 0:
            parts["logprobs"] = np.concatenate([parts["logprobs"], np.zeros(delta, dtype="<f4")])
        else:
            parts["logprobs"] = parts["logprobs"][:delta]

    return corrupt


@pytest.mark.parametrize(
    "corrupt, error, reason",
    [
        (_set("lease_id", "lease-other"), PayloadError, "reply names lease 'lease-other'"),
        (_set("lease_id", None), PayloadError, "reply names lease None"),
        (_set("version", -1), PayloadError, "no valid version"),
        (_set("version", "5"), PayloadError, "no valid version"),
        (_set("version", True), PayloadError, "no valid version"),
        (_set("version", 5.0), PayloadError, "no valid version"),
        (_set("version", None), PayloadError, "no valid version"),
        (_set("digest", ""), PayloadError, "no valid digest"),
        (_set("digest", "XYZ"), PayloadError, "no valid digest"),
        (_set("digest", DIGEST.upper()), PayloadError, "no valid digest"),
        (_set("digest", "a" * 129), PayloadError, "no valid digest"),
        (_set("digest", 12), PayloadError, "no valid digest"),
        (_lengths("completion_lengths", [4, 1, 2]), PayloadError, "completion_lengths must list 4 lengths"),
        (_lengths("completion_lengths", [4, 1, 2, 3, 1]), PayloadError, "completion_lengths must list 4 lengths"),
        (_lengths("completion_lengths", [5, 1, 1, 3]), PayloadError, "completion_lengths must hold integers in [1, 4]"),
        (_lengths("completion_lengths", [0, 1, 2, 3]), PayloadError, "completion_lengths must hold integers in [1, 4]"),
        (_lengths("completion_lengths", [4, 1, 2, "3"]), PayloadError, "completion_lengths must hold integers"),
        (_set("completion_lengths", None), PayloadError, "completion_lengths must list 4 lengths"),
        (_lengths("prompt_lengths", [3]), PayloadError, "prompt_lengths must list 2 lengths"),
        (_lengths("prompt_lengths", [2, 3]), PayloadError, "does not echo the lease's prompts (their lengths differ)"),
        (_lengths("completion_lengths", [3, 1, 2, 3]), PayloadSizeError, "reply payload has 100 bytes"),
        (_resize(1), PayloadSizeError, "reply payload has 104 bytes, its lengths say 100"),
        (_resize(-1), PayloadSizeError, "reply payload has 96 bytes, its lengths say 100"),
        (_poke("prompts", 4, 15), PayloadError, "does not echo the lease's prompts exactly"),
        (_poke("prompts", 0, 11), PayloadError, "does not echo the lease's prompts exactly"),
        (_poke("tokens", 3, VOCAB), PayloadError, "token ids outside [0, 258)"),
        (_poke("tokens", 9, 2**31 - 1), PayloadError, "token ids outside"),
        (_poke("tokens", 0, -1), PayloadError, "token ids outside"),
        (_poke("logprobs", 2, float("nan")), PayloadError, "not finite"),
        (_poke("logprobs", 2, float("-inf")), PayloadError, "not finite"),
        (_poke("logprobs", 9, 0.5), PayloadError, "above 0"),
        (_poke("logprobs", 0, 2 * LOGPROB_SLACK), PayloadError, "above 0"),
        (_set("envelope", 5), PayloadError, "reply's envelope is not a base64 string of a bounded size"),
        (_set("envelope", "A" * (2 * MAX_ENVELOPE_BYTES + 4)), PayloadError, "not a base64 string of a bounded"),
        (_set("envelope", "not base64!"), PayloadError, "reply's envelope is not valid base64"),
        (_set("envelope", "QUJ"), PayloadError, "reply's envelope is not valid base64"),
        (_set("compute_dtype", "float64"), PayloadError, "compute_dtype must be one of float32, bfloat16, float16"),
        (_set("compute_dtype", None), PayloadError, "compute_dtype must be one of"),
    ],
)
def test_decode_reply_refuses_a_reply_with_one_thing_wrong(corrupt: Any, error: type, reason: str) -> None:
    header, parts = good_reply()
    corrupt(header, parts)
    with pytest.raises(error) as caught:
        decode_reply(REPLY_LEASE, header, payload(parts), vocab_size=VOCAB)
    assert reason in str(caught.value)


def test_decode_reply_takes_rounding_slack_and_the_last_token_id() -> None:
    header, parts = good_reply()
    parts["logprobs"][0] = LOGPROB_SLACK / 2  # log-softmax rounding just above 0
    parts["tokens"][0] = VOCAB - 1
    del header["envelope"]  # optional: a version the trainer saw as head needs none
    samples = decode_reply(REPLY_LEASE, header, payload(parts), vocab_size=VOCAB)
    assert samples.completion_ids[0][0][0] == VOCAB - 1 and samples.envelope == b""


@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        "transformers",
        {},
        {"engine": "transformers"},
        *(
            dict(
                {
                    "engine": "transformers",
                    "version": 3,
                    "tokens_per_s": 10.0,
                    "samples_per_s": 1.0,
                    "queue": 0,
                    "served": 2,
                    "max_new_tokens": 64,
                },
                **change,
            )
            for change in [
                {"engine": 5},
                {"engine": "x" * 33},
                {"version": "3"},
                {"version": True},
                {"version": -2},
                {"version": 2**62},
                {"version": 3.0},
                {"queue": 1.5},
                {"served": None},
                {"max_new_tokens": -5},
                {"tokens_per_s": -1.0},
                {"tokens_per_s": float("nan")},
                {"samples_per_s": float("inf")},
                {"samples_per_s": "fast"},
                {"tokens_per_s": False},
            ]
        ),
    ],
)
def test_parse_worker_record_returns_none_for_malformed_values(value: Any) -> None:
    assert parse_worker_record(value) is None


def test_parse_worker_record_reads_what_a_worker_announces() -> None:
    info = WorkerInfo("transformers", -1, 0.0, 0.0, 0, 0, 512)
    assert parse_worker_record(info.to_record()) == info
    info = WorkerInfo("vllm", 12, 1500, 3.5, 2, 40, 64)
    parsed = parse_worker_record({**info.to_record(), "extra": "ignored"})
    assert parsed == info and isinstance(parsed.tokens_per_s, float)
    assert workers_key("r.policy") == "pulseloco:r.policy:rollout_workers"


# ================================================================================================================
# 2. workers on a real swarm
# ================================================================================================================


def public_pem(key: Any) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def random_prompts(num: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 11, (num,), generator=gen).tolist()
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def kill_tree(worker: WorkerProcess) -> None:
    """SIGKILL a worker process and everything it started (its DHT and libp2p daemon): the machine is gone."""
    main = psutil.Process(worker.process.pid)
    children = main.children(recursive=True)
    for proc in [main, *children]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    worker.process.join(10)  # reaped by multiprocessing, so that is_alive() says so
    psutil.wait_procs(children, timeout=10)


class Swarm:
    """The module's swarm: this process's DHT and publisher, two rollout worker processes ``A`` and ``B``."""

    def __init__(self, dht: Any, model_dir: Path, store: Path) -> None:
        from transformers import AutoModelForCausalLM

        from pulseloco.sync.publisher import Publisher
        from pulseloco.sync.signing import generate_key

        self.dht = dht
        self.model_dir = model_dir
        self.key = generate_key()
        self.workers: dict[str, WorkerProcess] = {}
        self.peer_ids: dict[str, str] = {}
        self.publisher: Any = None
        self.digests: dict[int, str] = {}
        try:
            for name in ("A", "B"):  # spawned first: they import and load while the publisher starts
                self.workers[name] = self._spawn(name)
            self.publisher = Publisher(dht, POLICY, self.key, store)
            # the versions the trainer holds to check leases with (a publisher's process hands them over)
            self.states = VersionStates(None, POLICY, None, {}, keep=8)
            self.model = AutoModelForCausalLM.from_pretrained(model_dir)  # the trainer's FP32 weights
            self.gen = torch.Generator().manual_seed(5)
            self.publish()
            for name in self.workers:
                self.workers[name].send("start", maddrs(dht))
            for name, worker in self.workers.items():
                self.peer_ids[name] = worker.receive(timeout=120)
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str) -> WorkerProcess:
        return WorkerProcess(
            rollout_worker, POLICY, public_pem(self.key), str(self.model_dir), {}, name=f"worker-{name}"
        )

    @property
    def version(self) -> int:
        assert self.publisher.version is not None
        return self.publisher.version

    @torch.no_grad()
    def publish(self) -> int:
        """A training step's worth of change (small noise on every weight), published and flushed."""
        for param in self.model.parameters():
            param.add_(torch.randn(param.shape, generator=self.gen) * 1e-2)
        self.publisher.publish(self.model)
        version = self.publisher.flush(timeout=60)
        assert version is not None
        self.digests[version] = self.publisher.digest
        assert self.digests[version] == bf16_digest(self.model)
        self.states.add(version, {n: t.detach().to(torch.bfloat16).clone() for n, t in self.model.state_dict().items()})
        return version

    def verifier(self, **options: Any) -> Any:
        """The trainer's check of the workers' leases, holding the published versions."""
        from pulseloco.rollouts.verify import RolloutVerifier
        from pulseloco.rollouts.verify_config import VerifyConfig

        return RolloutVerifier(VerifyConfig(**options), states=self.states, states_wait=5.0, seed=0)

    def sync(self, names: list[str] | None = None) -> None:
        """Bring workers to the newest version (each serves it when this returns)."""
        names = list(self.workers) if names is None else names
        for name in names:
            self.workers[name].send("update", self.version)
        for name in names:
            served = self.workers[name].receive(timeout=90)
            assert served == {"version": self.version, "digest": self.digests[self.version]}, (name, served)

    def ready(self) -> None:
        """Every worker alive (a killed one is replaced), honest, serving the newest version."""
        for name, worker in list(self.workers.items()):
            if not worker.process.is_alive():
                worker.close(timeout=5)
                # its record lives on for its TTL: overwrite it with a newer, malformed one that clients skip
                self.dht.store(workers_key(POLICY), {"gone": True}, get_dht_time() + 60, subkey=self.peer_ids[name])
                self.workers[name] = self._spawn(name)
                self.peer_ids[name] = self.workers[name].call("start", maddrs(self.dht), timeout=120)
        for worker in self.workers.values():
            worker.call("mode", "honest")
        self.sync()

    @contextlib.contextmanager
    def client(self, **options: Any) -> Iterator[RolloutClient]:
        """A client with ``options`` for its :class:`LeaseConfig`; backup leases off unless asked for: these tests
        count leases and check each worker's own, which a backup lease to the other worker would take over."""
        options.setdefault("backup_after", 0)
        client = RolloutClient(self.dht, POLICY, self.key.public_key(), vocab_size=VOCAB, config=LeaseConfig(**options))
        try:
            yield client
        finally:
            client.close()

    def wait_for_records(self, client: RolloutClient, versions: dict[str, int] | None = None) -> None:
        """Wait until the DHT shows each worker at its version (default: all at the newest)."""
        want = {self.peer_ids[n]: v for n, v in (versions or dict.fromkeys(self.workers, self.version)).items()}

        def announced() -> bool:
            found = client.workers(max_age=0)
            return all(peer in found and found[peer].version == v for peer, v in want.items())

        wait_for(announced, 30, f"worker records at {want}", interval=0.2)

    def close(self) -> None:
        close_all(list(self.workers.values()))
        if self.publisher is not None:
            self.publisher.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("rollout-model") / "tiny-llama")


@pytest.fixture(scope="module")
def dht() -> Iterator[Any]:
    """This module's DHT: the publisher's and the clients' here, and the swarm's first peer for everyone else."""
    node = start_dht()
    yield node
    node.shutdown()


@pytest.fixture(scope="module")
def swarm_module(dht: Any, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    swarm = Swarm(dht, model_dir, tmp_path_factory.mktemp("rollout-store"))
    yield swarm
    swarm.close()


@pytest.fixture
def swarm(swarm_module: Swarm) -> Swarm:
    swarm_module.ready()
    return swarm_module


@pytest.mark.timeout(120)
def test_a_batch_is_shared_by_both_workers_and_every_group_answered_once(swarm: Swarm) -> None:
    prompts = random_prompts(12, seed=1)
    version = swarm.version
    with swarm.client(lease_timeout=30, rollout_timeout=30) as client:
        swarm.wait_for_records(client)
        results = client.submit(prompts, num_samples=4, max_new_tokens=16, temperature=1.0).result(timeout=90)
        stats = client.stats
    assert len(results) == len(prompts)
    for result in results:
        assert (result.version, result.digest) == (version, swarm.digests[version])
        assert len(result.completion_ids) == len(result.logprobs) == 4
        for ids, logprobs in zip(result.completion_ids, result.logprobs):
            assert 1 <= len(ids) == len(logprobs) <= 16
            assert all(0 <= t < VOCAB for t in ids)
            assert all(math.isfinite(lp) and lp <= LOGPROB_SLACK for lp in logprobs)
    # 12 groups cut for 2 workers x 2 leases each: 4 leases of 3 groups, 2 to each worker, none re-leased
    assert (stats.leases, stats.released, stats.failed, stats.refused, stats.stale_dropped) == (4, 0, 0, 0, 0)
    assert dict(stats.by_worker) == {swarm.peer_ids["A"]: 24, swarm.peer_ids["B"]: 24}
    assert {r.worker for r in results} == set(swarm.peer_ids.values())
    assert not stats.refusals

    # The completions are samples of the published weights for their own group's prompt: the workers'
    # log-probabilities match the published BF16 weights' (teacher forcing here, batched generation there)
    reference = copy.deepcopy(swarm.model).to(torch.bfloat16).eval()
    assert bf16_digest(reference) == swarm.digests[version]
    own, other = [], []
    for g, result in enumerate(results):
        for ids, logprobs in zip(result.completion_ids, result.logprobs):
            expected = reference_logprobs(reference, prompts[g], ids, 1.0)
            own.append(max(abs(a - b) for a, b in zip(logprobs, expected)))
            wrong = reference_logprobs(reference, prompts[(g + 1) % len(prompts)], ids, 1.0)
            other.append(max(abs(a - b) for a, b in zip(logprobs, wrong)))
    # BF16 rounding differs between a padded batch and one sequence (about 0.07 at most here); a completion scored
    # under another group's prompt is off by 1.5 or more
    assert max(own) < 0.3, max(own)
    assert sorted(other)[len(other) // 4] > 1.0, sorted(other)


@pytest.mark.timeout(120)
def test_a_stale_workers_completions_are_dropped_and_generated_again(swarm: Swarm) -> None:
    """B stops following at version v while A follows to v + max_lag + 1: B's replies are dropped as stale and
    their groups generated again by A.

    The client last read the head at v, so B's record does not look stale when the batch starts (a worker that
    falls behind while it holds leases): B takes leases, A's first reply (B is slower) makes the client read the
    newer head, and B's replies are then dropped, B cooled down and skipped while its record shows it behind."""
    max_lag = 1
    old = swarm.version
    swarm.workers["B"].call("mode", "slow", 1.5)
    with swarm.client(max_lag=max_lag, lease_timeout=30, rollout_timeout=30) as client:
        assert client.newest_version() == old  # this trainer saw B's version published
        for _ in range(max_lag + 1):
            swarm.publish()
        swarm.sync(["A"])
        assert swarm.version == old + max_lag + 1  # the client has not read the head since
        swarm.wait_for_records(client, {"A": swarm.version, "B": old})
        future = client.submit(random_prompts(8, seed=2), num_samples=2, max_new_tokens=8, temperature=1.0)
        results = future.result(timeout=60)
        stats = client.stats
    assert len(results) == 8 and all(len(r.completion_ids) == 2 for r in results)
    assert {(r.version, r.digest, r.worker) for r in results} == {
        (swarm.version, swarm.digests[swarm.version], swarm.peer_ids["A"])
    }
    # B generated (it took two of the four leases at the start) and every one of its completions was dropped
    assert swarm.workers["B"].call("stats")["served"] >= 2
    assert stats.stale_dropped >= 8 and stats.stale_dropped % 4 == 0, stats
    assert swarm.peer_ids["B"] not in stats.by_worker
    assert stats.refused == 0 and not stats.refusals  # stale is not dishonest


@pytest.mark.timeout(60)
def test_a_batch_of_fewer_leases_than_slots_goes_to_as_many_workers(swarm: Swarm) -> None:
    """Two groups, two workers with two lease slots each: one lease to each worker, not both to the fastest (with
    eight workers and eight groups, half the workers sat idle while the other half generated two leases each)."""
    with swarm.client(lease_timeout=30, rollout_timeout=30) as client:
        swarm.wait_for_records(client)
        results = client.submit(random_prompts(2, seed=11), num_samples=2, max_new_tokens=4, temperature=1.0).result(
            timeout=60
        )
        stats = client.stats
    assert stats.leases == 2 and len(results) == 2
    assert dict(stats.by_worker) == {swarm.peer_ids["A"]: 2, swarm.peer_ids["B"]: 2}


@pytest.mark.timeout(90)
def test_a_stragglers_lease_is_backed_up_by_an_idle_worker(swarm: Swarm) -> None:
    """Two groups, one lease each; B answers only after 15 s. Once A has answered its lease and B's has been out
    twice as long, B's lease goes to the idle A as well: A's reply completes the batch, B's lease is released, and
    every group is taken once. Without backups (``backup_after=0``) the batch would wait out B's 15 s."""
    delay = 15.0
    swarm.workers["B"].call("mode", "slow", delay)
    with swarm.client(lease_timeout=60, rollout_timeout=30, backup_after=2.0) as client:
        swarm.wait_for_records(client)
        start = time.monotonic()
        future = client.submit(random_prompts(2, seed=12), num_samples=2, max_new_tokens=4, temperature=1.0)
        results = future.result(timeout=60)
        elapsed = time.monotonic() - start
        stats = client.stats
    assert elapsed < delay, elapsed
    assert [r.worker for r in results] == [swarm.peer_ids["A"]] * 2
    assert (stats.leases, stats.backups, stats.backups_won, stats.released, stats.failed) == (3, 1, 1, 1, 0), stats
    assert dict(stats.by_worker) == {swarm.peer_ids["A"]: 4} and not stats.refusals


@pytest.mark.timeout(90)
def test_a_batch_is_cut_by_each_workers_measured_rate(swarm: Swarm) -> None:
    """B answers each lease 2 s late (a slow machine or link). The first batch, with no rate measured, is cut
    evenly; from then on each worker's part follows its measured rate, so the fast A takes most of the next batch
    instead of both waiting for B's even half (backups off, so that only the cut balances)."""
    swarm.workers["B"].call("mode", "slow", 2.0)
    a, b = swarm.peer_ids["A"], swarm.peer_ids["B"]
    with swarm.client(lease_timeout=30, rollout_timeout=30, backup_after=0.0) as client:
        swarm.wait_for_records(client)
        client.submit(random_prompts(8, seed=13), num_samples=2, max_new_tokens=4, temperature=1.0).result(timeout=60)
        first = dict(client.stats.by_worker)
        assert first == {a: 8, b: 8}  # even: 4 leases of 2 groups
        assert client.stats.rates[a] > 2 * client.stats.rates[b], client.stats.rates
        results = client.submit(random_prompts(16, seed=14), num_samples=2, max_new_tokens=4, temperature=1.0).result(
            timeout=60
        )
        second = {peer: n - first.get(peer, 0) for peer, n in client.stats.by_worker.items()}
    assert len(results) == 16
    assert second[a] >= 3 * second.get(b, 0) and second[a] + second.get(b, 0) == 32, second


@pytest.mark.timeout(60)
def test_a_trainer_that_publishes_knows_the_newest_version_without_reading_the_dht(swarm: Swarm) -> None:
    """A client told of its own publisher's versions (SwarmRollouts beside a PulseSyncCallback with the key) takes
    the newest from there: no DHT read of the head on a round's path, which costs round trips over a WAN."""
    old = swarm.version
    with swarm.client() as client:
        assert client.newest_version() == old and not client.own_publisher  # read from the DHT
        client.note_published(old + 3, "d" * 64)  # announced by this process (the DHT head still says old)
        assert client.own_publisher
        assert client.newest_version() == old + 3 and client.lag(old) == 3
        assert client.check_version(old + 3, "d" * 64) is None
        assert client.check_version(old, swarm.digests[old]) is None  # seen in the head record before


@pytest.mark.timeout(60)
def test_a_trainer_pushes_each_new_head_to_its_workers(swarm: Swarm) -> None:
    """The trainer that publishes sends each new head record (the signed bytes in the DHT) to the workers it knows:
    each worker's subscriber checks it and goes to that version at its next update, without its poll and DHT
    lookup of the head. The same record again is not taken; the workers then serve the version."""
    from pulseloco.sync.transport import read_signed_head

    with swarm.client() as client:
        swarm.wait_for_records(client)  # the client knows both workers
        before = {name: worker.call("stats")["pushed"] for name, worker in swarm.workers.items()}
        version = swarm.publish()
        signed = read_signed_head(swarm.dht, POLICY, swarm.key.public_key())
        assert signed is not None and signed[0].version == version
        client.push_head(version, signed[1])
        wait_for(lambda: client.stats.heads_pushed == 2, 15, "both workers to take the pushed head", interval=0.1)
        assert all(worker.call("stats")["pushed"] == before[name] + 1 for name, worker in swarm.workers.items())
        client.push_head(version, signed[1])
        time.sleep(1.0)
        assert client.stats.heads_pushed == 2  # held already: not taken again
    swarm.sync()  # each worker's next update goes to the pushed version


@pytest.mark.timeout(60)
def test_a_worker_one_version_behind_is_not_refused(swarm: Swarm) -> None:
    """B serves v, A serves v + 1, max_lag 2: B's completions are honest and within the lag. This trainer's client
    starts after v + 1 was published (a trainer joining a running swarm), so it never saw v as the head: B's reply
    proves v with the publisher's signed envelope of the object that brought it there."""
    old = swarm.version
    swarm.publish()
    swarm.sync(["A"])
    with swarm.client(max_lag=2, max_refusals=2, lease_timeout=30, rollout_timeout=30) as client:
        swarm.wait_for_records(client, {"A": old + 1, "B": old})
        results = client.submit(random_prompts(8, seed=7), num_samples=2, max_new_tokens=8, temperature=1.0).result(
            timeout=60
        )
        stats = client.stats
    assert len(results) == 8  # A completes the batch either way
    assert stats.refused == 0 and not stats.refusals, stats
    assert swarm.peer_ids["B"] in stats.by_worker
    assert {(r.version, r.digest) for r in results} <= {(v, swarm.digests[v]) for v in (old, old + 1)}


@pytest.mark.timeout(90)
def test_a_lease_waits_for_its_oldest_usable_version(swarm: Swarm) -> None:
    """Leases whose ``min_version`` the workers do not hold yet (a round the trainer sent ahead, which it would drop
    as stale if made with their version) are generated with that version once the workers have it."""
    old = swarm.version
    with swarm.client(lease_timeout=30, rollout_timeout=30) as client:
        swarm.wait_for_records(client)
        prompts = random_prompts(4, seed=3)
        future = client.submit(prompts, num_samples=2, max_new_tokens=8, temperature=1.0, min_version=old + 1)
        time.sleep(1.5)
        assert not future.done()  # both workers hold the old version: they wait
        version = swarm.publish()
        swarm.sync()
        results = future.result(timeout=60)
    assert {(r.version, r.digest) for r in results} == {(version, swarm.digests[version])}


@pytest.mark.timeout(120)
def test_a_lease_for_a_version_that_never_comes_holds_a_worker_back_for_a_bounded_time(swarm: Swarm) -> None:
    """A lease naming a version the workers never get (a stranger's, or a trainer's mistake) waits at most
    ``MIN_VERSION_WAIT_S`` and is answered not_ready: each worker's one generation thread goes on to the leases
    queued behind it long before that lease's deadline."""
    from pulseloco.rollouts.worker import MIN_VERSION_WAIT_S

    with swarm.client(lease_timeout=120, rollout_timeout=120) as blocker, swarm.client(lease_timeout=120) as client:
        swarm.wait_for_records(blocker)
        swarm.wait_for_records(client)
        never = swarm.version + 100
        stuck = blocker.submit(
            random_prompts(2, seed=5), num_samples=1, max_new_tokens=4, temperature=1.0, min_version=never
        )
        time.sleep(1.0)  # each worker holds a lease of it
        started = time.monotonic()
        results = client.submit(random_prompts(2, seed=6), num_samples=1, max_new_tokens=4, temperature=1.0).result(
            timeout=60
        )
        took = time.monotonic() - started
        assert not stuck.done()  # asked again and again, never served
        stuck.cancel()
    assert len(results) == 2 and took < MIN_VERSION_WAIT_S + 15, took


@pytest.mark.timeout(60)
def test_only_stale_workers_end_the_batch(swarm: Swarm) -> None:
    """Both workers hold a version more than max_lag behind the newest: none is usable, so the batch fails with
    NoWorkersError after rollout_timeout (as with no workers at all) instead of regenerating forever."""
    with swarm.client(max_lag=0, lease_timeout=30, rollout_timeout=2) as client:
        swarm.wait_for_records(client)
        old = swarm.version
        assert client.newest_version() == old
        swarm.publish()  # the workers do not follow
        assert client.newest_version() == old + 1
        future = client.submit(random_prompts(4, seed=6), num_samples=2, max_new_tokens=4, temperature=1.0)
        try:
            with pytest.raises(NoWorkersError, match=r"2 more than max_lag=0 versions behind"):
                future.result(timeout=6)
        finally:
            future.cancel()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mode, reason",
    [
        ("vocab", "reply holds token ids outside [0, 258)"),
        ("digest", "digest 0000000000000000 is not the published digest of version {v}"),
        ("version", "version {claimed} was not published (no head record or signed envelope says so)"),
        ("envelope", "the signed envelope names version {v}, digest {digest}, not the claimed"),
        ("forged", "the envelope of version {claimed} does not verify"),
        ("oversize", "above the limit of"),
        ("garbage", "message header is not JSON"),
    ],
)
def test_a_rogue_worker_is_refused_and_the_honest_one_completes_the_batch(
    swarm: Swarm, mode: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """B answers on the real handler with a reply that fails a check: each reply is refused (never raised), after
    max_refusals B is refused for the run with the reason, and A generates every group. (A rogue that claims
    another version claims v + 1000.)"""
    swarm.workers["B"].call("mode", mode)
    reason = reason.format(v=swarm.version, claimed=swarm.version + 1000, digest=swarm.digests[swarm.version][:16])
    with swarm.client(max_refusals=2, lease_timeout=30, rollout_timeout=30) as client:
        swarm.wait_for_records(client)
        results = client.submit(random_prompts(8, seed=3), num_samples=2, max_new_tokens=8, temperature=1.0).result(
            timeout=90
        )
        stats = client.stats
        assert swarm.peer_ids["B"] not in client.workers(max_age=0)  # no more leases for it
    rogue = swarm.peer_ids["B"]
    assert list(stats.refusals) == [rogue] and reason in stats.refusals[rogue], stats.refusals
    assert stats.refused >= 2
    # The rogue's replies are refused, never failed; a lease of A may fail in transport on a loaded machine (the
    # client leases it again: "the stream ended without a header" was seen so in a fresh-clone run).
    failures = [r for r in caplog.records if r.name == "pulseloco.rollouts.client" and r.msg.startswith("lease failed")]
    assert stats.failed == len(failures) and all(r.args[0] != rogue for r in failures), caplog.text  # type: ignore[index]
    assert rogue not in stats.by_worker
    assert len(results) == 8
    assert {(r.version, r.digest, r.worker) for r in results} == {
        (swarm.version, swarm.digests[swarm.version], swarm.peer_ids["A"])
    }
    assert swarm.workers["B"].call("stats")["served"] >= 2  # it did answer; its answers were refused


def settle_batch(swarm: Swarm, client: RolloutClient, groups: list[list[int]], verifier: Any) -> Any:
    """A batch through the trainer's path (:func:`pulseloco.rollouts.verify.settle`): leased, checked with the
    trainer's FP32 model, failed leases generated again by the workers (never by the trainer here: a batch that
    needs it fails the test)."""
    from pulseloco.integrations.settle import settle

    options = {"num_samples": 2, "max_new_tokens": LEASE_TOKENS, "temperature": 1.0}

    def regenerate(indices: list[int], last: bool) -> list[Any]:
        assert not last, "the workers did not produce a batch that passes the checks"
        return client.submit([groups[i] for i in indices], **options).result(timeout=90)

    first = client.submit(groups, **options).result(timeout=90)
    return settle(
        first,
        groups,
        client=client,
        verifier=verifier,
        model=swarm.model,
        max_lag=2,
        temperature=1.0,
        max_new_tokens=LEASE_TOKENS,
        stop_ids={EOS},
        regenerate=regenerate,
        attempts=6,
    )


LEASE_TOKENS = 12
EOS = 256


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "mode, reason, refusals",
    [
        ("other_weights", "tokens are not the replayable sampler's choice", 2),
        ("forged_logprobs", "log-probabilities differ from the trainer's by up to", 2),
        ("cherry_pick", "tokens are not the replayable sampler's choice", 2),
        ("inject", "tokens are not the replayable sampler's choice", 2),
        ("replay", "tokens are not the replayable sampler's choice", 2),
        ("truncate", "stopped before max_new_tokens without an end-of-sequence token", 2),
        ("steer", "an honest engine's rounding makes about", None),
    ],
)
def test_a_dishonest_worker_never_reaches_the_loss_and_is_refused(
    swarm: Swarm, mode: str, reason: str, refusals: int | None
) -> None:
    """B's replies pass every protocol check (published version and digest, well-formed), but its completions are
    not the replayable sampler's: the trainer's checks fail each of its leases, its groups are generated again by A,
    B is refused after max_refusals failed leases with the reason (a steering worker, whose tokens stay inside the
    margin, at once by the near-miss guard, in the first batch, whose every lease of B fails: ``refusals`` None),
    and no completion of B is in the batch. A, honest, never fails a check."""
    verifier = swarm.verifier()
    honest, rogue = swarm.peer_ids["A"], swarm.peer_ids["B"]
    with swarm.client(max_refusals=2, lease_timeout=30, rollout_timeout=30) as client:
        swarm.wait_for_records(client)
        if mode == "replay":  # a past to replay: honest leases first
            client.submit(
                random_prompts(8, seed=9), num_samples=2, max_new_tokens=LEASE_TOKENS, temperature=1.0
            ).result(90)
            assert client.stats.by_worker[rogue] > 0
        swarm.workers["B"].call("mode", mode)
        for batch in range(4):  # until B is refused; every batch must come out clean
            settled = settle_batch(swarm, client, random_prompts(8, seed=10 + batch), verifier)
            assert {r.worker for r in settled.results} == {honest}
            if rogue in client.stats.refusals:
                break
        stats = client.stats
    assert list(stats.refusals) == [rogue] and reason in stats.refusals[rogue], (stats.refusals, verifier.stats)
    assert stats.check_failures[honest] == 0
    if refusals is None:
        assert batch == 0 and stats.check_failures[rogue] >= 1 and verifier.stats.guard_refusals >= 1
    else:
        # refused at the max_refusals-th failed lease; every lease of that batch is checked, so a fast rogue with
        # more leases in it has more failed (CI: 3 with max_refusals 2), each reported once
        assert refusals <= stats.check_failures[rogue] == verifier.stats.failed_leases, verifier.stats
    print(
        f"{mode}: refused after {stats.check_failures[rogue]} failed leases; honest worker: "
        f"{verifier.stats.positions} positions checked, worst passing gap {verifier.stats.worst_passing_gap:.3f}, "
        f"worst passing log-probability error {verifier.stats.worst_passing_logprob_error:.4f}"
    )


@pytest.mark.timeout(120)
def test_log_probabilities_forged_within_the_tolerance_never_reach_trl(swarm: Swarm) -> None:
    """B lowers every log-probability by 90% of its precision's per-token tolerance: its leases pass (the
    tolerance is the engines' measured error), but the log-probabilities handed on for TRL's importance-sampling
    ratio are the trainer's own, so the batch is the one an honest worker gives, log-probability for
    log-probability: the forgery moves the ratio by nothing."""
    handed = []
    for mode in ("honest", "forged_within"):
        swarm.workers["A"].call("mode", mode)
        swarm.workers["B"].call("mode", mode)
        with swarm.client(max_refusals=1, lease_timeout=30, rollout_timeout=30) as client:
            swarm.wait_for_records(client)
            settled = settle_batch(swarm, client, random_prompts(8, seed=50), swarm.verifier())
            assert not client.stats.refusals and client.stats.check_failed == 0
        handed.append([(r.completion_ids, r.logprobs) for r in settled.results])
    assert handed[0] == handed[1]


@pytest.mark.timeout(120)
def test_with_every_worker_refused_the_batch_says_so(swarm: Swarm) -> None:
    """Both workers dishonest: both are refused after their first failed lease, and regenerating the dropped groups
    fails with NoWorkersError saying that the workers were refused (where SwarmRollouts applies its fallback)."""
    for name in ("A", "B"):
        swarm.workers[name].call("mode", "inject")
    with swarm.client(max_refusals=1, lease_timeout=30, rollout_timeout=5) as client:
        swarm.wait_for_records(client)
        with pytest.raises(NoWorkersError, match="2 refused for failing the checks"):
            settle_batch(swarm, client, random_prompts(8, seed=40), swarm.verifier())
        assert set(client.stats.refusals) == set(swarm.peer_ids.values())


@pytest.mark.parametrize("weights", ["shared", "version"])
def test_honest_workers_pass_the_checks_at_the_version_they_claim(swarm: Swarm, weights: str) -> None:
    """Both workers honest (BF16), the trainer checking with its FP32 weights: every lease passes and no worker is
    refused (false refusals: 0), the gaps and log-probability errors measured stay inside the BF16 tolerances, and
    the near misses stay at rounding's rate."""
    from pulseloco.rollouts.tolerances import TOLERANCES

    verifier = swarm.verifier(verify_weights=weights)
    with swarm.client(max_refusals=1, lease_timeout=30, rollout_timeout=30) as client:
        swarm.wait_for_records(client)
        for batch in range(3):
            settle_batch(swarm, client, random_prompts(16, seed=20 + batch), verifier)
        stats = client.stats
    assert not stats.refusals and stats.check_failed == 0, stats.refusals
    v = verifier.stats
    tolerance = TOLERANCES["bfloat16"]
    assert v.failed_leases == 0 and v.mismatches == 0 and v.positions > 500 and v.guard_refusals == 0
    assert v.worst_passing_gap < tolerance.margin / 4 and v.worst_passing_logprob_error < tolerance.logprob_error / 4
    print(
        f"honest ({weights}): {v.leases} leases, {v.positions} positions, {v.near} near misses, worst "
        f"gap {v.worst_passing_gap:.4f}, worst log-probability error {v.worst_passing_logprob_error:.5f}, "
        f"{v.shared_completions} of {v.completions} completions proven by the shared check, drift {v.drift:.3f}"
    )


@pytest.mark.timeout(120)
def test_a_lease_is_checked_with_the_weights_of_the_version_it_claims(swarm: Swarm) -> None:
    """A trainer that does not publish follows the published versions (VersionStates: a non-relaying Subscriber on
    its own DHT peer, BF16 copies of the newest few): a batch generated at version v and checked after two more
    versions is checked with v's weights (gaps within BF16 rounding), and passes in both modes. A version older
    than every one held is not waited for."""
    from pulseloco.rollouts.verify import RolloutVerifier
    from pulseloco.rollouts.verify_config import VerifyConfig

    template = {n: t for n, t in swarm.model.state_dict().items() if t.is_floating_point()}
    trainer_dht = start_dht(maddrs(swarm.dht))  # another peer: this process publishes, and cannot fetch from itself
    states = VersionStates(trainer_dht, POLICY, swarm.key.public_key(), template, keep=4)
    try:
        wait_for(lambda: states.get(swarm.version) is not None, 30, f"version {swarm.version} held")
        with swarm.client(max_refusals=1, lease_timeout=30, rollout_timeout=30) as client:
            swarm.wait_for_records(client)
            groups = random_prompts(8, seed=30)
            results = client.submit(groups, num_samples=2, max_new_tokens=LEASE_TOKENS, temperature=1.0).result(90)
            generated = swarm.version
            for _ in range(2):
                swarm.publish()
            wait_for(lambda: states.get(swarm.version) is not None, 30, f"version {swarm.version} held")
            # a version published and superseded between two looks may be skipped; these two are held
            assert {generated, swarm.version} <= set(states.versions())
            assert bf16_digest(states.get(generated)) == swarm.digests[generated]
            options = {"temperature": 1.0, "max_new_tokens": LEASE_TOKENS, "stop_ids": {EOS}}
            for weights in ("version", "shared"):
                verifier = RolloutVerifier(VerifyConfig(verify_weights=weights), states=states)  # type: ignore[arg-type]
                checks = verifier.check(swarm.model, groups, results, **options)
                failed = [c for c in checks.values() if c.reason is not None]
                assert not failed, f"{len(failed)} of {len(checks)} leases failed: {failed}"
                assert verifier.stats.mismatches == 0
        started = time.monotonic()
        assert states.wait(generated - 5, timeout=10) is None and time.monotonic() - started < 1
    finally:
        states.close()
        trainer_dht.shutdown()
    swarm.sync()


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_lease_costs_at_most_its_lease_timeout(swarm: Swarm) -> None:
    """B takes its leases, starts generating slowly and is SIGKILLed with its DHT and daemon: its leases go to A,
    the batch completes with every group answered once, within the lease timeout and a margin. (Runs last among
    the swarm tests: B is replaced if a later test needs it.)"""
    lease_timeout = 8.0
    swarm.workers["B"].call("mode", "slow", 5.0)
    prompts = random_prompts(12, seed=4)
    with swarm.client(lease_timeout=lease_timeout, rollout_timeout=30) as client:
        swarm.wait_for_records(client)
        future = client.submit(prompts, num_samples=4, max_new_tokens=16, temperature=1.0)
        wait_for(lambda: swarm.workers["B"].call("stats")["started"] >= 1, 30, "B to start its first lease")
        kill_tree(swarm.workers["B"])
        killed = time.monotonic()
        results = future.result(timeout=lease_timeout + 60)
        elapsed = time.monotonic() - killed
        stats = client.stats
    assert elapsed < lease_timeout + 10, elapsed
    assert len(results) == 12
    assert all(len(r.completion_ids) == 4 and r.worker == swarm.peer_ids["A"] for r in results)
    assert all(r.version == swarm.version for r in results)
    # B's two leases (one generating, one queued) came back, as did any later one sent to it (no dial)
    assert stats.released >= 2 and stats.failed == stats.released, stats
    assert dict(stats.by_worker) == {swarm.peer_ids["A"]: 48}  # each group taken once, all from A
    assert stats.stale_dropped == 0 and not stats.refusals
    assert stats.refused == 0  # a dead worker is not a dishonest one


@pytest.mark.timeout(60)
def test_no_workers_fails_the_batch_or_keeps_waiting(dht: Any, caplog: pytest.LogCaptureFixture) -> None:
    """No worker follows the run: after rollout_timeout the batch fails with a message saying how to start one, or,
    with ``wait``, a warning says so every rollout_timeout and the batch waits until cancelled. (First: a bad batch
    seed or group ids are refused at once.)"""
    from pulseloco.sync.signing import generate_key

    key = generate_key().public_key()
    with contextlib.closing(
        RolloutClient(dht, "nobody.policy", key, vocab_size=VOCAB, config=LeaseConfig(rollout_timeout=2))
    ) as client:
        for bad, reason in (  # refused before anything is leased
            ({"seed": -1}, "seed must be in"),
            ({"seed": 2**63}, "seed must be in"),
            ({"group_ids": [0, 0]}, "group_ids must be 2 distinct integers >= 0"),
            ({"group_ids": [3]}, "group_ids must be 2 distinct"),
            ({"group_ids": [0, -1]}, "group_ids must be 2 distinct"),
            ({"group_ids": [0, 2**31]}, "overflow 32-bit sequence indices"),
        ):
            with pytest.raises(ValueError, match=reason):
                client.submit([[1, 2], [3]], num_samples=2, max_new_tokens=4, temperature=1.0, **bad)
        assert client.stats.leases == 0
        started = time.monotonic()
        with pytest.raises(NoWorkersError) as caught:
            client.submit([[1, 2, 3]], num_samples=2, max_new_tokens=4, temperature=1.0).result(timeout=30)
        assert 2 <= time.monotonic() - started < 8
        message = str(caught.value)
        assert "no rollout worker of run 'nobody.policy' could take a lease for 2 s" in message
        assert "python recipes/rollout_worker.py --serve_rollouts --run_id nobody --initial_peers" in message

    caplog.set_level(logging.WARNING, logger="pulseloco.rollouts.client")
    with contextlib.closing(
        RolloutClient(dht, "nobody.policy", key, vocab_size=VOCAB, config=LeaseConfig(rollout_timeout=1))
    ) as client:
        future = client.submit([[1, 2, 3]], num_samples=2, max_new_tokens=4, temperature=1.0, wait=True)

        def warned() -> list[str]:
            return [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]

        wait_for(lambda: len(warned()) >= 2, 20, "two waiting warnings")
        assert "--serve_rollouts --run_id nobody" in warned()[0]
        assert not future.done()
        future.cancel()
        wait_for(future.done, 5, "the cancelled batch to end")
        assert future.cancelled()


# ================================================================================================================
# 3. the recipes
# ================================================================================================================

RUN_TIMEOUT_S = 240.0


class Run:
    """A recipe process whose stdout and stderr go to a log file."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRL_EXPERIMENTAL_SILENCE="1")
        with log.open("wb") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=log.parent, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, code: int = 0, timeout: float = RUN_TIMEOUT_S) -> str:
        try:
            returned = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{self.log.name} did not finish in {timeout:.0f} s:\n{self.text()[-4000:]}") from None
        assert returned == code, f"{self.log.name} exited with {returned}:\n{self.text()[-4000:]}"
        return self.text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        run.stop()


def grpo(model_dir: Path, out: Path, *args: str) -> list[str]:
    argv = [sys.executable, str(RECIPES / "grpo.py"), "--config", str(CONFIG), "--model_name_or_path", str(model_dir)]
    small = ["--num_eval_prompts", "4", "--num_train_prompts", "64", "--linger", "0", "--logging_steps", "1"]
    return [*argv, "--output_dir", str(out), *small, *args]


@pytest.fixture(scope="module")
def keypair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pulseloco.cli import main as pulseloco_main

    path = tmp_path_factory.mktemp("rollout-keys") / "publisher"
    assert pulseloco_main(["keygen", "--out", str(path)]) == 0
    return path


@pytest.mark.timeout(300)
def test_grpo_without_workers_falls_back_to_local_generation(
    tmp_path: Path, model_dir: Path, keypair: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``--rollouts swarm`` on a trainer alone in its swarm: after --rollout_timeout the round is generated by the
    trainer's own model, it says so and how to start a worker, and training goes on. The recipe's command line
    runs in this process (tests/recipe_helpers.py: a process would spend its first ten CPU-seconds importing
    torch, transformers and TRL; the test below runs trainers as processes)."""
    from recipe_helpers import run_in_process

    from pulseloco.recipes import grpo as recipe

    out = tmp_path / "alone"
    swarm_args = ["--run_id", "alone", "--max_steps", "1", "--inner_steps", "1", "--target_group_size", "1"]
    rollout_args = ["--publish", "--signing_key", str(keypair), "--rollouts", "swarm", "--rollout_timeout", "3"]
    argv = grpo(model_dir, out, *swarm_args, *rollout_args)[2:]
    result = run_in_process(capfd, "grpo.py", lambda: recipe.main(argv))
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert "rollouts: from the swarm's workers of run_id=alone.policy" in log
    assert "rollouts=swarm" in log
    assert log.count("generating this round locally") == 1, log[-3000:]
    assert "no rollout worker of run 'alone.policy' could take a lease for 3 s" in log
    assert "start one with `python recipes/rollout_worker.py --serve_rollouts --run_id alone" in log
    (record,) = read_json_lines(out / "rollouts.jsonl")
    assert record["local"] is True and record["workers"] == ["local"] and record["versions"] == [-1], record
    assert record["completions"] == 16 and record["num_generations"] == 8 and record["seconds_waiting"] >= 3
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 1
    assert "grpo: done steps=1" in log


BAD_FLAGS = [
    (["--rollouts", "bogus"], "rollouts must be one of local, swarm, got 'bogus'"),
    (["--rollouts", "swarm", "--rollout_fallback", "x"], "invalid choice: 'x' (choose from 'local', 'wait')"),
    (["--rollouts", "swarm", "--max_lag", "-1"], "max_lag must be >= 0, got -1"),
    (["--rollouts", "swarm", "--lease_timeout", "0"], "lease_timeout must be a positive number of seconds, got 0"),
    (["--rollouts", "swarm", "--backup_after", "0.5"], "backup_after must be 0 (off) or a factor of at least 1"),
    (["--rollouts", "swarm"], "--rollouts swarm needs --public_key PATH (the publisher's .pub file), or --publish"),
]


def test_grpo_refuses_bad_rollout_flags_with_one_line(
    tmp_path: Path, model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every case raises the recipe's one-line ConfigError before anything is written; the last, refused after the
    arguments were parsed and the callbacks made, also as a user sees it from the recipe's command line
    (``common.run_recipe``, in this process: tests/recipe_helpers.py): exit code 2 and that one line, nothing else."""
    from recipe_helpers import run_in_process

    from pulseloco.errors import ConfigError
    from pulseloco.recipes import grpo as recipe

    for i, (args, expected) in enumerate(BAD_FLAGS):
        out = tmp_path / f"bad{i}"
        with pytest.raises(ConfigError) as caught:
            recipe.main(grpo(model_dir, out, *args)[2:])
        assert expected in str(caught.value) and "\n" not in str(caught.value), (args, str(caught.value))
        assert not out.exists(), args
    args, expected = BAD_FLAGS[-1]
    out = tmp_path / "printed"
    result = run_in_process(capfd, "grpo.py", lambda: recipe.main(grpo(model_dir, out, *args)[2:]))
    text = result.stdout + result.stderr
    lines = [line for line in text.splitlines() if line.strip()]
    assert result.returncode == 2, text
    assert len(lines) == 1 and lines[0].startswith("grpo.py: error: ") and expected in lines[0], (args, text)
    assert not out.exists(), args  # refused before anything was written


def worker_run(model_dir: Path, run_id: str, bootstrap: str, keypair: Path, out: Path) -> Run:
    """``recipes/rollout_worker.py --serve_rollouts`` following ``run_id``'s policy, logging to ``out``.log."""
    argv = [sys.executable, str(RECIPES / "rollout_worker.py"), "--serve_rollouts"]
    argv += ["--model_name_or_path", str(model_dir), "--run_id", run_id, "--initial_peers", bootstrap]
    argv += ["--public_key", f"{keypair}.pub", "--output_dir", str(out)]
    argv += ["--interval", "0.2", "--max_seconds", str(RUN_TIMEOUT_S), "--lease_max_new_tokens", "16"]
    return Run(argv, out.parent / f"{out.name}.log")


def trainer_run(model_dir: Path, run_id: str, bootstrap: str, keypair: Path, out: Path, *more: str) -> Run:
    """``recipes/grpo.py`` for 8 steps in one PULSELoCo round of its own, publishing, on swarm rollouts."""
    swarm_args = ["--run_id", run_id, "--initial_peers", bootstrap, "--max_steps", "8", "--inner_steps", "8"]
    swarm_args += ["--target_group_size", "1", "--matchmaking_time", "2"]
    rollout_args = ["--publish", "--signing_key", str(keypair), "--rollouts", "swarm", "--rollout_timeout", "90"]
    return Run(grpo(model_dir, out, *swarm_args, *rollout_args, *more), out.parent / f"{out.name}.log")


def load_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


@pytest.mark.timeout(300)
def test_grpo_trains_on_a_rollout_workers_completions_and_a_dishonest_worker_changes_nothing(
    runs: list[Run], tmp_path: Path, tiny_warm_model: Path, keypair: Path, dht: Any
) -> None:
    """Two runs at once from the tiny warm model (it earns rewards that differ within a group, so its weights move),
    each a trainer (``--rollouts swarm --publish``) with an honest ``rollout_worker.py
    --serve_rollouts``:

    - alone: every round's completions come from the worker at a published version, checked, and TRL computed its
      importance-sampling ratio between its own log-probabilities and the worker's;
    - beside a dishonest worker (a real worker process that samples from other weights while claiming the published
      digest, and announces a huge throughput, which the trainer does not rank it by) and an honest one (the same
      engine, dtype and sampler as ``rollout_worker.py``, in a worker process of the tests): it is refused after
      ``max_refusals`` failed leases with the reason, none of its completions is in any round, and, since a group
      generated again is sampled with the same noise and the only version trained on is the first, the trainer
      ends with weights bit for bit those of the run without it."""
    bootstrap = maddrs(dht)[0]
    alone, rogue_run = tmp_path / "alone", tmp_path / "rogue"
    runs.append(worker_run(tiny_warm_model, "fed", bootstrap, keypair, tmp_path / "worker"))
    pem = Path(f"{keypair}.pub").read_bytes()
    # beside the rogue, an honest worker that computes as rollout_worker.py does (FP32 on the BF16 values), forked
    # from the tests' preloaded server like the rogue
    honest = WorkerProcess(
        rollout_worker, "fed-rogue.policy", pem, str(tiny_warm_model), {"dtype": "float32"}, name="honest"
    )
    rogue = WorkerProcess(rollout_worker, "fed-rogue.policy", pem, str(tiny_warm_model), {}, name="rogue")
    try:
        honest_peer = honest.call("start", [bootstrap], timeout=120)
        rogue_peer = rogue.call("start", [bootstrap], timeout=120)
        rogue.call("mode", "other_weights")
        trainer = trainer_run(tiny_warm_model, "fed", bootstrap, keypair, alone)
        runs.append(trainer)
        # backup leases off: one to the honest worker could take over a lease of the rogue, which then is not refused
        beside_args = ("--max_refusals", "2", "--backup_after", "0")
        beside = trainer_run(tiny_warm_model, "fed-rogue", bootstrap, keypair, rogue_run, *beside_args)
        runs.append(beside)
        for worker in (honest, rogue):  # the trainer's first version, the only one before its last step
            assert worker.call("update", 1, 120.0, timeout=150)["version"] == 1
        rogue.call("boast")
        log = trainer.wait()
        beside_log = beside.wait()
    finally:
        close_all([honest, rogue])
    runs[0].stop()
    worker_log = runs[0].text()

    assert "generating this round locally" not in log, log[-3000:]
    published = {p["version"]: p["digest"] for p in read_json_lines(alone / "pulsesync_versions.jsonl")}
    assert sorted(published) == [1, 2]  # the starting weights, then the one outer round
    rounds = read_json_lines(alone / "rollouts.jsonl")
    assert [r["round"] for r in rounds] == list(range(1, 9)), rounds
    peer = worker_log.split("rollout: serving leases peer_id=")[1].split()[0]
    for record in rounds:
        assert record["local"] is False and record["workers"] == [peer], record
        assert record["by_worker"] == {peer: 16} and record["completions"] == 16
        assert record["versions"] == [1] and record["lags"] == [0, 0] and record["newest_version"] == 1
        assert record["refused"] == record["failed"] == record["stale_dropped"] == 0
        # every completion checked, first with the trainer's weights (the check's log-probabilities answered TRL's
        # importance-sampling forward pass of every earlier round: this record is written before this round's), and
        # those that did not pass there with the weights of the version they claim; every lease passed
        checked = record["verify"]
        assert checked["failed_leases"] == 0 and checked["leases"] >= record["round"] and checked["mismatches"] == 0
        assert checked["completions"] == 16 * record["round"] and checked["shared_forwards"] == record["round"] - 1
        assert checked["shared_completions"] + checked["audited_completions"] <= checked["completions"], checked
        assert checked["guard_refusals"] == 0 and checked["unverifiable_leases"] == 0, checked
    for before, after in itertools.pairwise(rounds):
        # the next round's leases went out before this round's results were back: the worker queued them
        assert after["prefetched"] and after["sent"] <= before["received"], (before, after)
    worker_versions = read_json_lines(tmp_path / "worker" / "rollouts.jsonl")
    assert worker_versions[0]["version"] == 1 and worker_versions[0]["digest"] == published[1]
    # the worker's timeline of each lease it served: the trainer's 8 rounds of 2 leases (and the rounds the checks
    # sent again), each made with version 1 once it had arrived, waited for and generated
    leases = read_json_lines(tmp_path / "worker" / "leases.jsonl")
    assert len(leases) >= 16 and len({lease["lease_id"] for lease in leases}) == len(leases)
    for lease in leases:
        assert lease["received"] <= lease["began"] <= lease["started"] <= lease["finished"], lease
        assert lease["version"] == 1 >= lease["min_version"] and lease["completions"] > 0, lease
        assert 0 < lease["seconds"] <= lease["finished"] - lease["started"] + 0.01, lease

    state = json.loads((alone / "trainer_state.json").read_text())
    assert state["global_step"] == 8
    logged = [e for e in state["log_history"] if "sampling/importance_sampling_ratio/mean" in e]
    assert len(logged) == 8, state["log_history"]
    for entry in logged:
        assert 0.5 < entry["sampling/importance_sampling_ratio/mean"] < 2.0, entry
        # the ratio's denominators are the trainer's own log-probabilities (of the version, or the current weights')
        assert entry["sampling/sampling_logp_difference/mean"] < 0.1, entry
    assert all(e.get("rollouts/local") == 0.0 for e in state["log_history"] if "rollouts/local" in e)
    # The same logs reach report_to (the config's tensorboard): the rollout loop's, the round's and the versions'
    from tensorboard_helpers import scalars

    series = scalars(alone / "tensorboard")
    assert [step for step, _ in series["train/rollouts/lag_mean"]] == list(range(1, 9))
    assert [value for _, value in series["train/rollouts/local"]] == [0.0] * 8
    assert series["train/pulseloco/round"] == [(8, 0.0)]
    assert [value for _, value in series["train/pulsesync/version"]] == [1, 2]

    # the run beside the dishonest worker
    assert "generating this round locally" not in beside_log, beside_log[-3000:]
    beside_rounds = read_json_lines(rogue_run / "rollouts.jsonl")
    assert len(beside_rounds) == 8
    for record in beside_rounds:
        assert record["by_worker"] == {honest_peer: 16} and record["versions"] == [1], record
    last = beside_rounds[-1]
    assert list(last["refused_workers"]) == [rogue_peer], last
    assert "tokens are not the replayable sampler's choice" in last["refused_workers"][rogue_peer]
    assert last["check_failed"] == 2 and last["verify"]["failed_leases"] == 2, last
    mine, theirs = load_weights(alone), load_weights(rogue_run)
    assert mine.keys() == theirs.keys()
    initial = load_weights(tiny_warm_model)
    assert any(not torch.equal(mine[name], initial[name]) for name in mine), "training changed nothing"
    different = [name for name in mine if not torch.equal(mine[name], theirs[name])]
    assert not different, f"weights differ from the run without the dishonest worker: {different}"
