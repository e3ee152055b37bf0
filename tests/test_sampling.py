"""The replayable sampling rule (pulseloco/rollouts/sampling.py) and the trainer's check of it
(pulseloco/rollouts/verify.py, pulseloco/rollouts/tolerances.py), without a network: the hash against a
plain-Python reference, the noise's counter-based property, the sampling distribution, the transformers engine's
completions replayed exactly, the check's verdicts on hand-made dishonest completions and on attackers that aim just
inside its tolerances, the shared check's drift bound, and the near-miss guard's statistics."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from rollout_helpers import byte_tokenizer, lowest_id, save_tiny_model
from steering import steer

from pulseloco.errors import ConfigError
from pulseloco.rollouts import sampling
from pulseloco.rollouts.client import GroupResult
from pulseloco.rollouts.engines.hf import TransformersEngine
from pulseloco.rollouts.sampling import check_completions, choose, gumbel_noise
from pulseloco.rollouts.tolerances import (
    TOLERANCES,
    NearMissGuard,
    Tolerance,
    poisson_tail,
    precision_of,
    tolerance_for,
)
from pulseloco.rollouts.verify import RolloutVerifier
from pulseloco.rollouts.verify_config import VerifyConfig
from pulseloco.rollouts.verify_records import LeaseCheck
from pulseloco.rollouts.version_states import VersionStates

MASK = 0xFFFFFFFF


def fmix32(x: int) -> int:
    """MurmurHash3's finalizer in plain Python integers (the reference for the int64-lane version)."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & MASK
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & MASK
    return x ^ (x >> 16)


def reference_noise(seed: int, sequence: int, position: int, token: int) -> float:
    key = fmix32((position & MASK) ^ 0x9E3779B9)
    key = fmix32(key ^ (sequence & MASK))
    key = fmix32(key ^ ((seed >> 32) & MASK))
    key = fmix32(key ^ (seed & MASK))
    bits = fmix32(key ^ fmix32(token ^ 0x7F4A7C15)) >> 8
    u = (bits + 0.5) / (1 << 24)
    return -math.log(-math.log(u))


@pytest.mark.parametrize("seed", [0, 1, 2**32 + 7, 2**63 - 1])
def test_the_noise_is_the_documented_hash_bit_for_bit(seed: int) -> None:
    """The torch hash (32-bit lanes in int64, no overflow) equals plain integer arithmetic, at extreme seeds and
    counters too; the float32 noise agrees with float64 to rounding."""
    for sequence, position in [(0, 0), (5, 17), (2**31 + 3, 2**32 - 1)]:
        got = gumbel_noise(seed, sequence, position, 300)
        want = torch.tensor([reference_noise(seed, sequence, position, k) for k in range(300)], dtype=torch.float64)
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=2e-6)
        assert sampling._fmix32(torch.tensor([2**32 - 1]))[0].item() == fmix32(2**32 - 1)


def test_the_noise_of_any_position_is_regenerated_alone() -> None:
    """Counter-based: the noise at (seed, i, t) is the same computed alone or among many rows; it changes with each
    of seed, sequence, position and token, and is Gumbel distributed (mean Euler's constant, sd pi/sqrt(6))."""
    seeds = torch.tensor([9, 9, 9, 10])
    sequences = torch.tensor([0, 3, 3, 3])
    positions = torch.tensor([4, 4, 5, 5])
    together = gumbel_noise(seeds, sequences, positions, 64)
    for row in range(4):
        alone = gumbel_noise(int(seeds[row]), int(sequences[row]), int(positions[row]), 64)
        assert torch.equal(alone, together[row])
    assert len({tuple(r.tolist()) for r in together}) == 4
    many = gumbel_noise(torch.arange(4000), 1, 2, 256)
    assert abs(many.mean().item() - 0.5772) < 0.01 and abs(many.std().item() - math.pi / math.sqrt(6)) < 0.01


def test_choose_samples_the_tempered_softmax_and_reports_its_logprob() -> None:
    """Over many sequences the chosen tokens follow softmax(logits / T); each row holds the chosen token's exact
    log-probability and -inf elsewhere (what a greedy decoder then takes and reports)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(20, generator=gen) * 2
    n, t = 40000, 0.7
    out = choose(logits.expand(n, 20), t, torch.full((n,), 77), torch.arange(n), torch.zeros(n, dtype=torch.long))
    chosen = out.argmax(-1)
    probs = (logits / t).softmax(-1)
    freq = torch.bincount(chosen, minlength=20).double() / n
    assert (freq - probs.double()).abs().max() < 4 * math.sqrt(0.25 / n)
    assert torch.equal(out.isfinite().sum(-1), torch.ones(n, dtype=torch.long))
    assert torch.allclose(out.max(-1).values, (logits / t).log_softmax(-1)[chosen])


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    return TransformersEngine.from_pretrained(str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "m")))


def results_of(
    completions: list, prompts: list[list[int]], samples: int, seed: int, dtype: str = "bfloat16", version: int = 0
) -> list[GroupResult]:
    out = []
    for g in range(len(prompts)):
        mine = completions[g * samples : (g + 1) * samples]
        out.append(
            GroupResult(
                version,
                "d",
                [c.token_ids for c in mine],
                [c.logprobs for c in mine],
                "w",
                f"lease-{seed}",
                seed,
                g * samples,
                compute_dtype=dtype,
            )
        )
    return out


PROMPTS = [[10, 20, 30], [40, 50], [7, 8, 9, 10, 11]]


def states_of(model: torch.nn.Module, version: int = 0) -> VersionStates:
    """The published versions a trainer holds: ``version`` is ``model``'s weights in BF16."""
    states = VersionStates(None, "run.policy", None, {}, keep=4)
    states.add(version, {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()})
    return states


def verifier_of(model: torch.nn.Module, config: VerifyConfig | None = None, **options: object) -> RolloutVerifier:
    """A verifier holding version 0 as ``model``'s BF16 weights."""
    return RolloutVerifier(config, states=states_of(model), states_wait=0.0, seed=0, **options)  # type: ignore[arg-type]


def check_lease(
    verifier: RolloutVerifier, model: torch.nn.Module, completions: list, samples: int, seed: int = 5, **options: str
) -> LeaseCheck:
    """``verifier`` on one lease: ``samples`` completions of each of :data:`PROMPTS` (lease seed ``seed``), 16 tokens
    at most."""
    eos = byte_tokenizer().eos_token_id
    return verifier.check(
        model,
        PROMPTS,
        results_of(completions, PROMPTS, samples, seed, **options),
        temperature=1.0,
        max_new_tokens=16,
        stop_ids={eos},
    )[f"lease-{seed}"]


def test_the_transformers_engine_samples_what_the_trainer_replays(engine: TransformersEngine) -> None:
    """The engine's completions (a left-padded BF16 batch) replay exactly under the trainer's check (an unpadded
    forward of the same BF16 model): every position is the perturbed argmax (largest gap 0), the log-probabilities
    agree to BF16 rounding; the same seed repeats them and another seed does not."""
    repeated = [p for p in PROMPTS for _ in range(4)]
    got = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    assert [c.token_ids for c in engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)] == [
        c.token_ids for c in got
    ]
    assert [c.token_ids for c in engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=6)] != [
        c.token_ids for c in got
    ]
    verifier = verifier_of(engine.model, VerifyConfig(verify_weights="version"), record_gaps=True)
    lease = check_lease(verifier, engine.model, got, 4)
    assert lease.reason is None and lease.mismatches == 0 and lease.checked == sum(len(c.token_ids) for c in got)
    # BF16 rounding: a padded batch and an unpadded forward differ in log-probability by up to 0.48 nats a token
    # over 40,000 positions (pulseloco/rollouts/tolerances.py); over these ~200 the largest was below 0.02 until
    # transformers 5.19 (0.023). 0.05 still asks for rounding-sized errors, far inside the check's 2-nat tolerance.
    assert verifier.gaps is not None and max(verifier.gaps) == 0.0 and lease.max_logprob_error < 0.05


def test_a_group_keyed_by_its_sequence_indices_samples_the_same_in_any_batch(engine: TransformersEngine) -> None:
    """``sequences`` key each row's noise: the last two groups of a batch, generated again as their own batch in the
    other order with their sequence indices, come out token for token the same (so a group re-leased to another
    worker is the same sample); the default (row ``i`` is sequence ``i``) does not give them back."""
    repeated = [p for p in PROMPTS for _ in range(4)]
    whole = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    rows = list(range(8, 12)) + list(range(4, 8))  # the longest prompt first: the same padded width as the batch
    again = engine.generate_ids([repeated[r] for r in rows], max_new_tokens=16, temperature=1.0, seed=5, sequences=rows)
    assert [c.token_ids for c in again] == [whole[r].token_ids for r in rows]
    default = engine.generate_ids([repeated[r] for r in rows], max_new_tokens=16, temperature=1.0, seed=5)
    assert [c.token_ids for c in default] != [whole[r].token_ids for r in rows]
    for bad in ([0] * 7, [0, 1, 2, 3, 4, 5, 6, -1], [2**32] * 8):
        with pytest.raises(ValueError, match="sequences must be one integer in"):
            engine.generate_ids([repeated[r] for r in rows], max_new_tokens=4, temperature=1.0, seed=5, sequences=bad)


@pytest.mark.parametrize("weights", ["shared", "version"])
def test_the_check_fails_each_kind_of_dishonest_completion(engine: TransformersEngine, weights: str) -> None:
    """Hand-made lies, one lease each, in both modes: a token that is not the sampler's choice, another seed's
    samples (a cherry-picker's), a log-probability off by more than the tolerance on one token, a completion cut
    short without EOS, a token id the model does not have, a claimed precision no tolerance is measured for; the
    honest lease passes. A mismatch inside the margin is a near miss, not a failure."""
    repeated = [p for p in PROMPTS for _ in range(4)]
    honest = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    other_seed = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=6)

    def check(
        completions: list, margin: float | None = None, dtype: str = "bfloat16", error: float | None = None
    ) -> str | None:
        config = VerifyConfig(verify_weights=weights, verify_margin=margin, verify_max_logprob_error=error)  # type: ignore[arg-type]
        return check_lease(verifier_of(engine.model, config), engine.model, completions, 4, dtype=dtype).reason

    assert check(honest) is None
    flipped = list(honest)
    c = flipped[3]
    flipped[3] = type(c)([*c.token_ids[:2], (c.token_ids[2] + 1) % 256, *c.token_ids[3:]], c.logprobs)
    assert "not the replayable sampler's choice" in str(check(flipped, margin=0.0))
    assert "not the replayable sampler's choice" in str(check(other_seed, margin=0.0))
    tolerance = TOLERANCES["bfloat16"].logprob_error
    one_off = [type(c)(c.token_ids, [c.logprobs[0] - 1.05 * tolerance, *c.logprobs[1:]]) for c in honest]
    assert "log-probabilities differ from the trainer's by up to" in str(check(one_off))
    cut = [type(c)(c.token_ids[:3], c.logprobs[:3]) if i == 0 else c for i, c in enumerate(honest)]
    assert "stopped before max_new_tokens without an end-of-sequence token" in str(check(cut))
    foreign = [type(c)([*c.token_ids[:-1], 10_000], c.logprobs) if i == 2 else c for i, c in enumerate(honest)]
    assert "outside the model's vocabulary" in str(check(foreign))
    assert "no tolerance is measured for float64" in str(check(honest, dtype="float64"))
    assert check(flipped, margin=1e6, error=1e6) is None  # inside the margins: a near miss, not a failure


def test_a_log_probability_the_worker_sends_never_reaches_trl(engine: TransformersEngine) -> None:
    """Every log-probability lowered by 90% of the per-token tolerance passes the check (the engine check holds
    each token to the tolerance, not the mean), but what TRL's importance-sampling ratio divides by is the
    trainer's own: equal to the honest lease's, bit for bit, so the forgery moves the ratio by nothing. A NaN
    log-probability fails its lease instead of passing."""
    repeated = [p for p in PROMPTS for _ in range(4)]
    honest = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    lower = 0.9 * TOLERANCES["bfloat16"].logprob_error
    forged = [type(c)(c.token_ids, [lp - lower for lp in c.logprobs]) for c in honest]
    handed = []
    for completions in (honest, forged):
        verifier = verifier_of(engine.model)
        assert check_lease(verifier, engine.model, completions, 4).reason is None
        handed.append([verifier.sampling_logps(repeated[i], c.token_ids) for i, c in enumerate(completions)])
    assert handed[0] == handed[1] and all(v is not None for v in handed[0])
    nan = [type(c)(c.token_ids, [float("nan"), *c.logprobs[1:]]) if i == 0 else c for i, c in enumerate(honest)]
    reason = check_lease(verifier_of(engine.model), engine.model, nan, 4).reason
    assert "log-probabilities differ from the trainer's by up to inf" in str(reason)


def test_check_completions_counts_gaps_leads_and_bands_of_spread() -> None:
    """``check_completions`` directly: the second completion's token trails by a known gap; a margin per completion
    decides mismatch or near; the lead is the token's margin over the best other, negative where it trails; each
    checked position falls in the band of its spread (the argmax's lead over the runner-up), and a near miss is
    counted in its position's band; unchecked positions are not counted; token ids outside the vocabulary and NaN
    log-probabilities fail (never raise)."""
    vocab = 8
    logits = torch.zeros((2, 3, vocab))
    seeds, sequences = torch.tensor([1, 1]), torch.tensor([0, 1])
    noise = gumbel_noise(seeds.unsqueeze(1).expand(2, 3), sequences.unsqueeze(1), torch.arange(3), vocab)
    tokens = noise.argmax(-1)
    second = noise[1, 0].topk(2)
    tokens[1, 0] = second.indices[1]  # the runner-up: trails by this gap, which is the position's spread
    gap = (second.values[0] - second.values[1]).item()
    top = noise.topk(2, dim=-1).values
    spreads = top[..., 0] - top[..., 1]
    logprobs = torch.full((2, 3), -math.log(vocab))
    mask = torch.ones((2, 3))
    common = {"temperature": 1.0, "seeds": seeds, "sequences": sequences}
    strict = check_completions(logits, tokens, mask, logprobs, margin=torch.tensor([0.0, gap / 2]), **common)
    assert (strict[0].mismatches, strict[1].mismatches, strict[1].near) == (0, 1, 0)
    assert strict[1].worst_gap == pytest.approx(gap) and strict[1].logprob_error < 1e-6
    assert strict[1].lead == pytest.approx(-gap) and strict[0].lead == pytest.approx(float(spreads[0].min()))
    edges = torch.tensor([[gap / 2, gap * 2, 50.0]]).expand(2, 3)
    loose = check_completions(logits, tokens, mask, logprobs, margin=50.0, bands=edges, **common)
    assert (loose[1].mismatches, loose[1].near, loose[1].band_near) == (0, 1, (0, 1, 0))
    for row in range(2):
        want = [int((spreads[row] <= gap / 2).sum()), int(((spreads[row] > gap / 2) & (spreads[row] <= 2 * gap)).sum())]
        want.append(3 - sum(want))
        assert list(loose[row].band_positions) == want, row
    skip = torch.ones((2, 3), dtype=torch.bool)
    skip[1, 0] = False
    unchecked = check_completions(logits, tokens, mask, logprobs, margin=0.0, check=skip, **common)
    assert unchecked[1].mismatches == 0 and unchecked[1].checked == 2 and unchecked[1].band_positions[0] <= 2
    bad_tokens = tokens.clone()
    bad_tokens[0, 1], bad_tokens[1, 2] = vocab + 3, -1
    bad_logprobs = logprobs.clone()
    bad_logprobs[0, 0] = float("nan")
    bad = check_completions(logits, bad_tokens, mask, bad_logprobs, margin=1e6, **common)
    assert bad[0].mismatches == 1 and bad[1].mismatches == 1 and bad[0].max_logprob_error == math.inf


def test_shared_prompts_give_the_logits_of_a_whole_forward_pass(engine: TransformersEngine) -> None:
    """The check runs each distinct prompt once and its completions on the prompt's KV cache: the logits that predict
    every completion token are those of one forward pass over prompt and completion (FP32, to rounding), for
    prompts of several lengths, repeated prompts, and completions of 0, 1 and more tokens."""
    from pulseloco.rollouts.replay import Row, completion_logits

    model = copy.deepcopy(engine.model).float()
    rows = [
        (PROMPTS[0], [5, 6, 7]),
        (PROMPTS[0], [9]),
        (PROMPTS[1], [3, 4]),
        (PROMPTS[2], []),
        (PROMPTS[1], [8, 2, 1, 4]),
    ]
    chunk = [Row("lease", list(p), c, [0.0] * len(c), 5, i, 0) for i, (p, c) in enumerate(rows)]
    with torch.no_grad():
        got = completion_logits(model, chunk, 4)
    assert got.shape == (5, 4, model.config.vocab_size)
    with torch.no_grad():
        for i, (prompt, completion) in enumerate(rows):
            whole = model(input_ids=torch.tensor([prompt + completion])).logits[0]
            expected = whole[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
            assert torch.allclose(got[i, : len(completion)], expected, atol=1e-5), i


def test_verifier_settings_are_checked(engine: TransformersEngine) -> None:
    for name, bad in (
        ("verify_margin", -1.0),
        ("verify_margin", float("nan")),
        ("verify_max_logprob_error", 0.0),
        ("verify_audit", 0.0),
        ("verify_audit", 1.5),
        ("verify_false_refusal", 1.0),
        ("verify_ratio_error", -0.1),
        ("verify_weights", "trust"),
    ):
        with pytest.raises(ConfigError, match=name):
            VerifyConfig(**{name: bad})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs the published versions' weights"):
        check_lease(RolloutVerifier(), engine.model, [], 1)


def test_tolerances_are_those_of_the_coarser_precision_and_grow_below_temperature_one() -> None:
    assert precision_of("float32", torch.float32) == "float32"
    assert precision_of("float32", torch.bfloat16) == precision_of("bfloat16", "float32") == "bfloat16"
    assert precision_of("float16", "float32") == "bfloat16"
    with pytest.raises(ValueError, match="no tolerance is measured for int8"):
        precision_of("int8", "float32")
    cold = tolerance_for("bfloat16", torch.float32, 0.5)
    assert cold.margin == 2 * TOLERANCES["bfloat16"].margin and cold.rates == TOLERANCES["bfloat16"].rates
    assert cold.bands == tuple(2 * b for b in TOLERANCES["bfloat16"].bands)
    assert tolerance_for("float32", torch.float32, 2.0) == TOLERANCES["float32"]


def test_a_lease_is_checked_with_its_versions_weights_even_when_the_trainer_wraps_forward(
    engine: TransformersEngine,
) -> None:
    """The trainer has moved on from the version the worker sampled with, and its ``forward`` is wrapped in a
    closure over the module (as ``accelerate`` wraps it for autocast): the check builds its own model from the
    config and loads the held version into it, so the worker's completions pass with the BF16 tolerance in both
    modes; a version the trainer does not hold makes the lease unverifiable, not failed, until the worker has more
    such leases than :data:`UNVERIFIABLE_ALLOWANCE`."""
    from pulseloco.rollouts.verify import UNVERIFIABLE_ALLOWANCE

    trainer = copy.deepcopy(engine.model).float()
    original = trainer.forward
    trainer.forward = lambda *args, **kwargs: original(*args, **kwargs)  # a closure over the original module
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    repeated = [p for p in PROMPTS for _ in range(4)]
    got = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    for weights in ("version", "shared"):
        verifier = verifier_of(engine.model, VerifyConfig(verify_weights=weights))  # type: ignore[arg-type]
        lease = check_lease(verifier, trainer, got, 4)
        assert lease.reason is None and lease.shared < lease.completions, lease
    verifier = verifier_of(engine.model)
    for attempt in range(UNVERIFIABLE_ALLOWANCE + 1):
        lease = check_lease(verifier, trainer, got, 4, version=7)
        assert lease.unverifiable and (lease.reason is None) == (attempt < UNVERIFIABLE_ALLOWANCE), lease
    assert "claims version 7, which this trainer does not hold" in str(lease.reason)
    assert verifier.stats.unverifiable_leases == UNVERIFIABLE_ALLOWANCE and verifier.stats.failed_leases == 1
    # a version the trainer held and let go (it moved on): generated again, never counted against the worker
    verifier = verifier_of(engine.model)
    state = verifier.states.get(0)
    for version in (1, 2, 3, 4, 5):
        verifier.states.add(version, state)  # keep 4: version 0 goes
    assert verifier.states.dropped(0) and not verifier.states.dropped(7)
    for _ in range(2 * UNVERIFIABLE_ALLOWANCE):
        lease = check_lease(verifier, trainer, got, 4, version=0)
        assert lease.unverifiable and lease.evicted and lease.reason is None, lease
    assert verifier.stats.failed_leases == 0


def test_versions_within_max_lag_of_the_announced_one_are_held_while_announcing_lags() -> None:
    """A publisher hands each version to the states when it queues it, before announcing it: while announcing lags
    (a slow DHT), the ``keep`` newest versions can all be newer than what the workers serve. ``hold_from`` (the
    newest announced version less ``max_lag``) keeps those the workers may still claim, up to ``4 keep``."""
    states = VersionStates(None, "run.policy", None, {}, keep=2)
    state: dict[str, torch.Tensor] = {}
    for version in range(1, 5):
        states.add(version, state)
    assert states.versions() == [3, 4] and states.dropped(1) and states.dropped(2) and not states.dropped(3)
    states.hold_from(3)
    for version in range(5, 9):  # queued; announcing still at 5 (hold from 3)
        states.add(version, state)
    assert states.versions() == [3, 4, 5, 6, 7, 8]
    states.hold_from(6)  # announced 8: max_lag 2
    assert states.versions() == [6, 7, 8] and states.dropped(5)
    for version in range(9, 16):  # announcing stalls: at most 4 * keep held, the oldest go
        states.add(version, state)
    assert states.versions() == list(range(8, 16)) and states.dropped(7)


def trl_logps(
    model: torch.nn.Module, prompts: list[list[int]], completions: list, t: float
) -> tuple[torch.Tensor, ...]:
    """TRL's batch of ``completions`` (left-padded prompts, right-padded completions), its mask, width, and the
    per-token log-probabilities TRL's own forward pass computes of it (logits predicting the completion tokens,
    tempered, log-softmax, gathered)."""
    prompt_width, keep = max(map(len, prompts)), max(len(c.token_ids) for c in completions)
    ids = torch.zeros((len(completions), prompt_width + keep), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids[i, prompt_width - len(prompt) : prompt_width] = torch.tensor(prompt)
        ids[i, prompt_width : prompt_width + len(completion.token_ids)] = torch.tensor(completion.token_ids)
        mask[i, prompt_width - len(prompt) : prompt_width + len(completion.token_ids)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1 : -1] / t
    logps = logits.log_softmax(-1).gather(-1, ids[:, -keep:].unsqueeze(-1)).squeeze(-1)
    return ids, mask, torch.tensor(keep), logps


def test_the_shared_check_passes_on_the_trainers_weights_and_hands_trl_its_log_probabilities(
    engine: TransformersEngine,
) -> None:
    """``verify_weights="shared"`` (the default): where the trainer's weights are the version's (FP32 holding the
    BF16 values) the audit measures no drift and every completion not audited passes the shared check; the check's
    log-probabilities answer TRL's importance-sampling forward pass for TRL's batch (equal to what TRL computes;
    ``None`` for a batch with a row the check never saw), and the ratio's denominators are the trainer's too (the
    version's for the audited completions). Where the trainer has moved on, the completions the drift bound does
    not prove are checked with the version's weights and pass; TRL still gets the current log-probabilities."""
    repeated = [p for p in PROMPTS for _ in range(4)]
    got = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    trainer = copy.deepcopy(engine.model).float()  # the trainer's FP32 weights holding the version's BF16 values

    verifier = verifier_of(engine.model)
    lease = check_lease(verifier, trainer, got, 4)
    assert lease.reason is None and lease.shared + lease.audited == lease.completions == 12, lease
    assert 1 <= lease.audited < 12 and verifier.stats.drift == 0.0
    ids, mask, keep, trl = trl_logps(trainer, repeated, got, 1.0)
    shared = verifier.shared_logps(ids, mask, int(keep))
    real = mask[:, -int(keep) :].bool()
    assert shared is not None and shared.shape == trl.shape
    assert torch.allclose(shared[real], trl[real], atol=1e-4) and not shared[~real].any()
    for i, c in enumerate(got):  # the version's weights are the trainer's here: one set of log-probabilities
        handed = verifier.sampling_logps(repeated[i], c.token_ids)
        assert handed is not None and torch.allclose(torch.tensor(handed), trl[i][real[i]], atol=1e-4)
    mask[0, ids.shape[1] - int(keep) - 1] = 0  # a prompt the check never saw
    assert verifier.shared_logps(ids, mask, int(keep)) is None
    verifier.clear_shared()
    assert verifier.shared_logps(ids, torch.ones_like(ids), int(keep)) is None

    moved = copy.deepcopy(trainer)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in moved.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.01)
    verifier = verifier_of(engine.model)
    lease = check_lease(verifier, moved, got, 4)
    assert lease.reason is None and lease.shared + lease.audited < lease.completions, lease
    assert verifier.stats.drift > 0
    ids, mask, keep, trl = trl_logps(moved, repeated, got, 1.0)
    shared = verifier.shared_logps(ids, mask, int(keep))
    assert shared is not None and torch.allclose(shared[real], trl[real], atol=1e-4)
    # where the current log-probabilities are further from the version's than verify_ratio_error, nothing is proven
    # by the shared check: every ratio's denominators are then the version's own
    assert verifier.stats.ratio_error > 0
    strict = verifier_of(engine.model, VerifyConfig(verify_ratio_error=0.0))
    lease = check_lease(strict, moved, got, 4)
    assert (
        lease.reason is None
        and lease.shared == 0
        and all(strict.decided_by(repeated[i], c.token_ids) == "version" for i, c in enumerate(got))
    )


def test_a_worker_that_samples_with_the_trainers_newer_weights_passes_nothing_the_version_would_refuse(
    engine: TransformersEngine,
) -> None:
    """A worker that knows the trainer's current weights (a step past the version) samples with them and claims the
    version: the shared check proves none of its completions whose tokens are not the version's choice (their lead
    under the current weights is within the drift the audit measures), so each of those goes to the version's
    check, where the positions it changed are near misses or mismatches."""
    trainer = copy.deepcopy(engine.model).float()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.002)
    newer = TransformersEngine(copy.deepcopy(trainer).to(torch.bfloat16), engine.tokenizer)
    repeated = [p for p in PROMPTS for _ in range(8)]
    mixed = newer.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    honest = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    differ = [i for i, (a, b) in enumerate(zip(mixed, honest)) if a.token_ids != b.token_ids]
    assert differ
    verifier = verifier_of(engine.model)
    lease = check_lease(verifier, trainer, mixed, 8)
    assert lease.near + lease.mismatches > 0, lease
    for i in differ:
        assert verifier.decided_by(repeated[i], mixed[i].token_ids) != "shared", i


def test_a_steering_worker_is_refused_by_the_guard_within_three_leases(engine: TransformersEngine) -> None:
    """A worker that, at every position, takes the lowest-id token whose perturbed score trails the sampler's choice
    by less than 95% of the BF16 margin, with its true log-probabilities: no position is beyond the margin, so no
    lease fails on its own; the near-miss guard refuses the worker within three leases. An honest BF16 worker's
    leases, checked the same way, are never refused."""
    repeated = [p for p in PROMPTS for _ in range(8)]
    aim = 0.95 * TOLERANCES["bfloat16"].margin
    verifier = verifier_of(engine.model)
    trainer = copy.deepcopy(engine.model).float()
    refused_at = None
    for lease_index in range(3):
        seed = 100 + lease_index
        steered = steer(
            engine.model,
            repeated,
            aim=aim,
            choose=lowest_id,
            eos=256,
            max_new_tokens=16,
            temperature=1.0,
            seed=seed,
            sequences=None,
        )
        lease = check_lease(verifier, trainer, steered, 8, seed=seed)
        assert lease.mismatches == 0 and lease.near > 0, lease
        if lease.refuse is not None:
            refused_at = lease_index + 1
            break
    assert refused_at is not None and "an honest engine's rounding makes about" in str(lease.refuse)
    honest_verifier = verifier_of(engine.model)
    for seed in range(200, 206):
        honest = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=seed)
        assert check_lease(honest_verifier, trainer, honest, 8, seed=seed).reason is None


def test_a_new_workers_groups_with_near_misses_are_held_back_until_the_guard_can_refuse_a_steerer(
    engine: TransformersEngine,
) -> None:
    """Probation: from a worker the guard has too little evidence on (a new identity), every group with a near miss
    is held back (generated again, its completions kept nowhere) while its other groups pass; a worker that steers
    one completion a group (its steered tokens all near misses) gets none of them kept while it lasts. An honest BF16
    worker leaves probation once its widest band of spread has :func:`probation_positions` positions, and after that
    its near misses pass as before; FP32 claims need far fewer."""
    from pulseloco.rollouts.tolerances import probation_positions

    tolerance = TOLERANCES["bfloat16"]
    assert probation_positions(tolerance, 1e-6) == 451 and probation_positions(TOLERANCES["float32"], 1e-6) == 19
    assert probation_positions(Tolerance(1.0, (1.0,), (0.0,), 1.0), 1e-6) == 0  # a zero rate ends, at once
    repeated = [p for p in PROMPTS for _ in range(8)]
    trainer = copy.deepcopy(engine.model).float()
    verifier = verifier_of(engine.model)
    aim = 0.95 * tolerance.margin
    steered_groups = held = probation_leases = 0
    for seed in range(100, 130):
        # the first token of one completion of each group steered (a steerer that stays under the guard's bar for
        # a few leases), the rest the sampler's choice
        honest = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=seed)
        steered = steer(
            engine.model, repeated, aim=aim, eos=256, max_new_tokens=16, temperature=1.0, seed=seed, sequences=None,
            choose=lambda row, ids, close: min(close) if row % 8 == 0 and not ids else close[0],
        )  # fmt: skip
        mixed = [steered[i] if i % 8 == 0 else honest[i] for i in range(len(repeated))]
        lease = check_lease(verifier, trainer, mixed, 8, seed=seed)
        if lease.refuse is not None or not lease.probation:
            break
        assert lease.reason is None, lease
        probation_leases += 1
        held += len(lease.held_back)
        for g, prompt in enumerate(PROMPTS):
            kept = [verifier.sampling_logps(prompt, c.token_ids) is not None for c in mixed[g * 8 : (g + 1) * 8]]
            assert kept == [g not in lease.held_back] * 8, (g, lease.held_back)
            if mixed[g * 8].token_ids != honest[g * 8].token_ids:  # steered somewhere: a near miss there
                steered_groups += 1
                assert g in lease.held_back, (g, lease.held_back)
    assert probation_leases > 0 and steered_groups > 0 and held >= steered_groups
    assert verifier.stats.probation_held_back == 8 * held
    # after probation the guard decides as before: these flips land where rounding flips choices too (spreads of
    # hundredths of a nat), so they pass, the room docs/design.md names; a steerer aiming wider is refused
    assert lease.reason is None and not lease.probation and not lease.held_back, lease
    honest_verifier = verifier_of(engine.model)
    leases_on_probation = 0
    for seed in range(200, 260):
        honest = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=seed)
        lease = check_lease(honest_verifier, trainer, honest, 8, seed=seed)
        assert lease.reason is None
        if not lease.probation:
            break
        leases_on_probation += 1
    record = honest_verifier.guard.records[("w", tolerance)]
    assert not lease.probation and not lease.held_back and record.positions[-1] >= 451, record
    assert 0 < leases_on_probation < 60
    no_probation = verifier_of(engine.model, VerifyConfig(verify_probation=False))
    assert not check_lease(no_probation, trainer, mixed, 8, seed=100).held_back


def test_the_guard_refuses_honest_rates_rarely_and_steering_soon() -> None:
    """The guard's statistics with simulated counts (a fixed generator): 1,000 honest workers of 50 leases each,
    their near misses drawn at exactly each band's rate, are never refused (the bound says at most
    ``false_refusal`` each: 1e-6 here, so 1,000 of them are refused with probability below 0.1%); a worker that
    flips half of the positions of one band is refused within three leases in the bands above 0.05 nats, within
    twenty in the one below (few positions a lease, honest rate 2-10%), and not in the two narrowest (rounding
    itself flips a quarter to a half of those choices); one that claims another
    precision every other lease only splits its counts. The Poisson tail is the regularized incomplete gamma
    function (checked by summing the series)."""
    tolerance = TOLERANCES["bfloat16"]
    positions = [4, 3, 8, 15, 220]  # a lease's positions per band (the demo's shares of its 1,000 positions)
    rng = random.Random(0)
    for worker in range(1000):
        guard = NearMissGuard(1e-6)
        for _ in range(50):
            near = [sum(rng.random() < rate for _ in range(n)) for n, rate in zip(positions, tolerance.rates)]
            assert guard.add("w", positions, near, tolerance) is None, worker
    for band in range(2, len(positions)):  # in the two narrowest, rounding itself flips a quarter to a half
        guard = NearMissGuard(1e-6)
        refused = None
        for lease in range(1, 30):
            near = [0] * len(positions)
            near[band] = positions[band] // 2
            if guard.add("w", positions, near, tolerance) is not None:
                refused = lease
                break
        assert refused is not None and refused <= (3 if band > 2 else 20), (band, refused)
    guard = NearMissGuard(1e-6)
    fp32 = TOLERANCES["float32"]
    for lease in range(1, 20):  # alternating claims: each precision's counts still add up
        if lease % 2:
            reason = guard.add("w", [0, 0, 0, 15, 220], [0, 0, 0, 0, 20], tolerance)
        else:
            reason = guard.add("w", [5, 20], [0, 0], fp32)
        if reason is not None:
            break
    assert reason is not None and lease <= 3
    series = sum(math.exp(-3.0) * 3.0**k / math.factorial(k) for k in range(9, 60))
    assert poisson_tail(9, 3.0) == pytest.approx(series, rel=1e-9)
    assert poisson_tail(0, 3.0) == 1.0 and poisson_tail(2, 0.0) == 0.0


def test_lead_lost_is_the_lead_the_current_winner_gives_up_under_the_version() -> None:
    """``lead_lost`` by hand, with the winners ``check_completions`` found under the current logits: with the noise
    added to both, the current winner's lead shrinks by the drift that separates it from its best rival under the
    version's logits (masked positions are ignored)."""
    from pulseloco.rollouts.sampling import lead_lost

    vocab = 5
    seeds, sequences = torch.tensor([3]), torch.tensor([0])
    noise = gumbel_noise(3, 0, torch.arange(2), vocab)  # (2, vocab)
    current = torch.zeros((1, 2, vocab))
    current[0, :, 0] = 4.0  # token 0 wins at both positions
    version = current.clone()
    version[0, 0, 1] += 1.5  # at position 0 token 1 gains 1.5 nats on the winner
    version[0, 1, 2] += 9.0  # at position 1 (masked out below) token 2 gains more
    won: list[tuple[list[int], list[float]]] = []
    every = torch.ones((1, 2), dtype=torch.bool)
    check_completions(current, torch.zeros((1, 2), dtype=torch.long), every, torch.zeros((1, 2)), temperature=1.0,
                      seeds=seeds, sequences=sequences, margin=0.0, winners_out=won)  # fmt: skip
    ((ids, leads),) = won
    assert ids == [0, 0]
    scores_now, scores_then = current[0, 0] + noise[0], version[0, 0] + noise[0]
    lead_now = scores_now[0] - scores_now[1:].max()
    lead_then = scores_then[0] - scores_then[1:].max()
    assert leads[0] == pytest.approx(float(lead_now), abs=1e-5)
    winners, lead_tensor = torch.tensor([ids]), torch.tensor([leads])
    common = {"temperature": 1.0, "seeds": seeds, "sequences": sequences}
    mask = torch.tensor([[True, False]])
    got = lead_lost(version, winners, lead_tensor, mask, **common)
    assert got == pytest.approx(float(lead_now - lead_then), abs=1e-5) and 0 < got <= 1.5 + 1e-6
    assert lead_lost(version, winners, lead_tensor, every, **common) > got
    assert lead_lost(current, winners, lead_tensor, mask, **common) == pytest.approx(0.0, abs=1e-6)
