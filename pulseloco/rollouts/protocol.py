"""The rollout protocol between trainers and rollout workers: leases, replies, worker records, and their checks.

A trainer sends a worker a *lease* (one unary libp2p request, :class:`Lease`, a JSON object): some prompts in token
ids, how many samples of each, the sampling settings, a seed, each prompt's first sequence index and a deadline.
The worker answers in the stream protocol of :mod:`pulseloco.p2p`: a JSON header (:class:`ReplyHeader`: status,
lease id, the version and state digest it generated with, the prompt and completion lengths) and a binary payload,
little-endian::

    prompt tokens      int32[sum(prompt_lengths)]        the prompts echoed, in lease order
    completion tokens  int32[sum(completion_lengths)]    num_samples completions per prompt, prompt-major
    logprobs           float32[sum(completion_lengths)]  each token's sampling log-probability

Workers announce themselves in the DHT under ``pulseloco:<policy run>:rollout_workers``, one subkey per peer
(:class:`WorkerInfo`: engine, held version, measured throughput, queue length). Records are unsigned hints: a false
one costs a failed lease, never a wrong sample, since every reply is checked (:func:`decode_reply`).

Everything here is pure (no network): both sides validate what they receive with these functions, and a malformed
message raises :class:`pulseloco.errors.PayloadError` with the reason.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pulseloco.errors import PayloadError, PayloadSizeError
from pulseloco.sync.signing import MAX_ENVELOPE_BYTES

__all__ = [
    "COMPUTE_DTYPES",
    "MAX_LEASE_BYTES",
    "Lease",
    "ReplyHeader",
    "Samples",
    "WorkerInfo",
    "decode_lease",
    "decode_reply",
    "encode_reply",
    "parse_refusals",
    "parse_worker_record",
]

#: Bound on a lease request's bytes (hivemind's daemon carries unary messages up to 4 MiB).
MAX_LEASE_BYTES = 2 << 20
#: Bounds a worker enforces on any lease, whatever its own settings: samples per prompt, prompts per lease.
MAX_SAMPLES_PER_PROMPT = 256
MAX_PROMPTS_PER_LEASE = 4096
#: Sequence indices of the sampling noise are 32-bit (:mod:`pulseloco.rollouts.sampling` hashes 32-bit lanes).
MAX_SEQUENCE = 2**32
_DIGEST = re.compile(r"^[0-9a-f]{1,128}$")
_LEASE_ID = re.compile(r"^[0-9A-Za-z_.:-]{1,80}$")
#: The precisions a worker may compute in (:class:`ReplyHeader`'s ``compute_dtype``).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
#: A sampling log-probability is <= 0; this slack covers rounding in BF16/FP32 log-softmax.
LOGPROB_SLACK = 1e-3


#: Bounds on a refusal record that ``pulseloco status`` reads (trainers write them; strangers could too).
MAX_REFUSALS_LISTED = 256
MAX_REASON_CHARS = 300


def parse_refusals(value: Any) -> dict[str, str] | None:
    """A trainer's refusal record ``{worker peer id: reason}`` from a DHT value, or None when it is malformed."""
    if not isinstance(value, dict) or len(value) > MAX_REFUSALS_LISTED:
        return None
    for k, v in value.items():
        if not (isinstance(k, str) and 0 < len(k) <= 128 and k.isprintable()):
            return None
        if not (isinstance(v, str) and len(v) <= MAX_REASON_CHARS):
            return None
    return dict(value)


@dataclass(frozen=True)
class Lease:
    """What a trainer asks one worker to generate.

    ``prompts``: token ids of each distinct prompt (chat template applied by the trainer); ``num_samples``
    completions of each, sampled with plain ``temperature`` (no top-k or top-p, so the returned log-probabilities
    are those of the distribution sampled from) up to ``max_new_tokens`` tokens, by the replayable rule of
    :mod:`pulseloco.rollouts.sampling`: sample ``j`` of prompt ``p`` is sequence ``sequences[p] + j`` of the noise
    keyed by ``seed``. A trainer keys a batch by one seed and a prompt by its place in the batch, so a group
    generated again (by whichever worker, in whichever lease) is sampled with the same noise. ``deadline_s``:
    seconds the trainer waits for the reply; the worker drops a lease still queued past it. ``min_version``: the
    oldest version the trainer will still train on when the reply comes (``max_lag`` behind the newest it expects
    by then); a worker that holds an older one waits for it (at most
    :data:`pulseloco.rollouts.worker.MIN_VERSION_WAIT_S`, then answers ``not_ready``) instead of generating
    completions that would be dropped as stale. 0 (what a trainer that predates the field sends): any version.
    """

    run_id: str
    lease_id: str
    prompts: list[list[int]]
    num_samples: int
    max_new_tokens: int
    temperature: float
    seed: int
    deadline_s: float
    sequences: list[int]
    min_version: int = 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @property
    def num_completions(self) -> int:
        return len(self.prompts) * self.num_samples


def _int(raw: dict[str, Any], name: str, low: int, high: int) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise PayloadError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _float(raw: dict[str, Any], name: str, low: float, high: float) -> float:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PayloadError(f"{name} must be a finite number, got {value!r}")
    if not low < value <= high:
        raise PayloadError(f"{name} must be in ({low}, {high}], got {value!r}")
    return float(value)


def _json_object(blob: bytes, what: str) -> dict[str, Any]:
    try:
        raw = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PayloadError(f"{what} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise PayloadError(f"{what} must be a JSON object")
    return raw


def decode_lease(blob: bytes, *, run_id: str, vocab_size: int, max_new_tokens: int, max_prompt_tokens: int) -> Lease:
    """Parse and check a lease from the network against this worker's limits.

    Raises :class:`PayloadSizeError` for a request above :data:`MAX_LEASE_BYTES`, :class:`PayloadError` for
    anything else malformed: another run, token ids outside ``[0, vocab_size)``, an empty prompt or one longer
    than ``max_prompt_tokens``, more than ``max_new_tokens`` tokens asked for, a temperature outside (0, 10].
    """
    if len(blob) > MAX_LEASE_BYTES:
        raise PayloadSizeError(f"lease of {len(blob)} bytes is above the limit of {MAX_LEASE_BYTES}")
    raw = _json_object(blob, "lease")
    if raw.get("run_id") != run_id:
        raise PayloadError(f"lease for run {raw.get('run_id')!r}, this worker serves {run_id!r}")
    lease_id = raw.get("lease_id")
    if not isinstance(lease_id, str) or not _LEASE_ID.match(lease_id):
        raise PayloadError(f"malformed lease_id {lease_id!r}")
    prompts = raw.get("prompts")
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_PROMPTS_PER_LEASE:
        raise PayloadError(f"prompts must be a list of 1 to {MAX_PROMPTS_PER_LEASE} token lists")
    checked: list[list[int]] = []
    for prompt in prompts:
        if not isinstance(prompt, list) or not 1 <= len(prompt) <= max_prompt_tokens:
            raise PayloadError(f"each prompt must be a list of 1 to {max_prompt_tokens} token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
            raise PayloadError(f"prompt token ids must be integers in [0, {vocab_size})")
        checked.append(prompt)
    num_samples = _int(raw, "num_samples", 1, MAX_SAMPLES_PER_PROMPT)
    sequences = raw.get("sequences")
    last = MAX_SEQUENCE - num_samples
    if (
        not isinstance(sequences, list)
        or len(sequences) != len(checked)
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= last for s in sequences)
    ):
        raise PayloadError(f"sequences must be one integer in [0, {last}] per prompt ({len(checked)})")
    return Lease(
        run_id=run_id,
        lease_id=lease_id,
        prompts=checked,
        num_samples=num_samples,
        max_new_tokens=_int(raw, "max_new_tokens", 1, max_new_tokens),
        temperature=_float(raw, "temperature", 0.0, 10.0),
        seed=_int(raw, "seed", 0, 2**63 - 1),
        deadline_s=_float(raw, "deadline_s", 0.0, 86400.0),
        sequences=list(sequences),
        min_version=_int(raw, "min_version", 0, 2**63 - 1) if "min_version" in raw else 0,
    )


@dataclass(frozen=True)
class ReplyHeader:
    """A worker's answer to a lease (the first message of its stream; ``size`` is added by the stream protocol).

    ``status``: ``ok``, ``busy`` (its queue is full: ask another worker), ``not_ready`` (it holds no version yet)
    or ``error`` (the lease was refused; ``error`` says why). When ok: ``version`` and ``digest`` of the weights
    every completion of the lease was generated with, ``envelope`` (base64): the publisher's signed envelope of the
    object that brought the worker to that version, which proves the claim to a trainer that never saw that
    version's head record, the lengths that cut the payload, and ``compute_dtype``, the precision the engine
    computed in (one of :data:`COMPUTE_DTYPES`: the trainer's check tolerates that precision's numerical
    differences, no more).
    """

    status: str
    lease_id: str = ""
    version: int = -1
    digest: str = ""
    prompt_lengths: tuple[int, ...] = ()
    completion_lengths: tuple[int, ...] = ()
    compute_dtype: str = ""
    error: str = ""
    seconds: float = 0.0
    envelope: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["prompt_lengths"] = list(self.prompt_lengths)
        out["completion_lengths"] = list(self.completion_lengths)
        return out


@dataclass(frozen=True)
class Samples:
    """The completions of one lease, checked: per prompt of the lease, ``num_samples`` token lists and their
    log-probabilities, generated with ``version`` (state digest ``digest``); the lease's ``seed`` and ``sequences``
    key their sampling noise."""

    version: int
    digest: str
    completion_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    compute_dtype: str = "bfloat16"
    seconds: float = 0.0
    envelope: bytes = b""
    lease_id: str = ""
    seed: int = 0
    sequences: tuple[int, ...] = ()


def encode_reply(
    lease: Lease,
    version: int,
    digest: str,
    completions: list[tuple[list[int], list[float]]],
    seconds: float,
    envelope: bytes = b"",
    *,
    compute_dtype: str,
) -> tuple[ReplyHeader, list[bytes]]:
    """The header and payload buffers of an ok reply: ``completions`` in lease order (prompt-major), generated in
    ``compute_dtype`` (one of :data:`COMPUTE_DTYPES`; ``ValueError`` otherwise)."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r}")
    prompt_tokens = np.asarray([t for p in lease.prompts for t in p], dtype="<i4")
    completion_tokens = np.asarray([t for ids, _ in completions for t in ids], dtype="<i4")
    logprobs = np.asarray([lp for _, lps in completions for lp in lps], dtype="<f4")
    header = ReplyHeader(
        status="ok",
        lease_id=lease.lease_id,
        version=version,
        digest=digest,
        prompt_lengths=tuple(len(p) for p in lease.prompts),
        completion_lengths=tuple(len(ids) for ids, _ in completions),
        compute_dtype=compute_dtype,
        seconds=round(seconds, 4),
        envelope=base64.b64encode(envelope).decode(),
    )
    return header, [prompt_tokens.tobytes(), completion_tokens.tobytes(), logprobs.tobytes()]


def reply_max_bytes(lease: Lease) -> int:
    """The largest payload an honest reply to ``lease`` can have (the reader's bound)."""
    prompt_tokens = sum(len(p) for p in lease.prompts)
    return 4 * prompt_tokens + 8 * lease.num_completions * lease.max_new_tokens


def _int_list(value: Any, name: str, length: int, low: int, high: int) -> list[int]:
    if not isinstance(value, list) or len(value) != length:
        raise PayloadError(f"{name} must list {length} lengths, got {value!r:.80}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in value):
        raise PayloadError(f"{name} must hold integers in [{low}, {high}]")
    return value


def decode_reply(lease: Lease, header: dict[str, Any], payload: bytes, *, vocab_size: int) -> Samples:
    """Check an ok reply to ``lease`` and cut it into :class:`Samples`.

    Raises :class:`PayloadError` naming the first check that failed: another lease id, a malformed version or
    digest, lengths that do not match the lease (number of completions, a completion empty or longer than
    ``max_new_tokens``, a payload of another size), prompts not echoed exactly, token ids outside
    ``[0, vocab_size)``, log-probabilities that are not finite or above 0, a ``compute_dtype`` not among
    :data:`COMPUTE_DTYPES`. The version is not checked against
    the published ones here (the caller knows them).
    """
    if header.get("lease_id") != lease.lease_id:
        raise PayloadError(f"reply names lease {header.get('lease_id')!r:.80}, expected {lease.lease_id!r}")
    version = header.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise PayloadError(f"reply has no valid version: {version!r:.80}")
    digest = header.get("digest")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise PayloadError(f"reply has no valid digest: {digest!r:.80}")
    compute_dtype = header.get("compute_dtype")
    if compute_dtype not in COMPUTE_DTYPES:
        raise PayloadError(
            f"reply's compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r:.40}"
        )
    prompt_lengths = _int_list(header.get("prompt_lengths"), "prompt_lengths", len(lease.prompts), 1, 1 << 20)
    lengths = _int_list(
        header.get("completion_lengths"), "completion_lengths", lease.num_completions, 1, lease.max_new_tokens
    )
    if prompt_lengths != [len(p) for p in lease.prompts]:
        raise PayloadError("reply does not echo the lease's prompts (their lengths differ)")
    num_prompt, num_completion = sum(prompt_lengths), sum(lengths)
    if len(payload) != 4 * num_prompt + 8 * num_completion:
        raise PayloadSizeError(
            f"reply payload has {len(payload)} bytes, its lengths say {4 * num_prompt + 8 * num_completion}"
        )
    prompt_tokens = np.frombuffer(payload, dtype="<i4", count=num_prompt)
    tokens = np.frombuffer(payload, dtype="<i4", count=num_completion, offset=4 * num_prompt)
    logprobs = np.frombuffer(payload, dtype="<f4", count=num_completion, offset=4 * (num_prompt + num_completion))
    expected = np.asarray([t for p in lease.prompts for t in p], dtype="<i4")
    if not np.array_equal(prompt_tokens, expected):
        raise PayloadError("reply does not echo the lease's prompts exactly")
    if num_completion and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise PayloadError(f"reply holds token ids outside [0, {vocab_size})")
    if not np.isfinite(logprobs).all():
        raise PayloadError("reply holds log-probabilities that are not finite")
    if num_completion and float(logprobs.max()) > LOGPROB_SLACK:
        raise PayloadError(f"reply holds log-probabilities above 0 (max {float(logprobs.max()):.4g})")
    ends = np.cumsum([0, *lengths])
    token_list, logprob_list = tokens.tolist(), logprobs.tolist()
    completion_ids: list[list[list[int]]] = []
    completion_logprobs: list[list[list[float]]] = []
    for p in range(len(lease.prompts)):
        ids_p, lps_p = [], []
        for s in range(lease.num_samples):
            k = p * lease.num_samples + s
            ids_p.append(token_list[ends[k] : ends[k + 1]])
            lps_p.append(logprob_list[ends[k] : ends[k + 1]])
        completion_ids.append(ids_p)
        completion_logprobs.append(lps_p)
    raw_envelope = header.get("envelope", "")
    if not isinstance(raw_envelope, str) or len(raw_envelope) > 2 * MAX_ENVELOPE_BYTES:
        raise PayloadError("reply's envelope is not a base64 string of a bounded size")
    try:
        envelope = base64.b64decode(raw_envelope, validate=True)
    except (binascii.Error, ValueError):
        raise PayloadError("reply's envelope is not valid base64") from None
    seconds = header.get("seconds", 0.0)
    return Samples(
        version=version,
        digest=digest,
        completion_ids=completion_ids,
        logprobs=completion_logprobs,
        compute_dtype=str(compute_dtype),
        seconds=float(seconds) if isinstance(seconds, int | float) and math.isfinite(seconds) else 0.0,
        envelope=envelope,
        lease_id=lease.lease_id,
        seed=lease.seed,
        sequences=tuple(lease.sequences),
    )


@dataclass(frozen=True)
class WorkerInfo:
    """A rollout worker's DHT record: ``engine`` (transformers or vllm), the ``version`` it serves (-1: none yet),
    measured ``tokens_per_s`` and ``samples_per_s`` (0 before its first lease), leases waiting in its ``queue``,
    leases ``served`` so far, and its limits ``max_new_tokens``."""

    engine: str
    version: int
    tokens_per_s: float
    samples_per_s: float
    queue: int
    served: int
    max_new_tokens: int

    def to_record(self) -> dict[str, Any]:
        return asdict(self)


def parse_worker_record(value: Any) -> WorkerInfo | None:
    """A :class:`WorkerInfo` from a DHT value, or None when it is malformed (strangers write these)."""
    if not isinstance(value, dict):
        return None
    try:
        engine = value["engine"]
        numbers = [value[k] for k in ("version", "queue", "served", "max_new_tokens")]
        rates = [value[k] for k in ("tokens_per_s", "samples_per_s")]
    except KeyError:
        return None
    if not isinstance(engine, str) or len(engine) > 32:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and -1 <= v < 2**62 for v in numbers):
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in rates):
        return None
    return WorkerInfo(engine, numbers[0], float(rates[0]), float(rates[1]), numbers[1], numbers[2], numbers[3])
