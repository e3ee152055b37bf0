"""The replayable sampling rule (pulseloco/rollouts/sampling.py) and the trainer's check of it
(pulseloco/integrations/verify.py), without a network: the hash against a plain-Python reference, the noise's
counter-based property, the sampling distribution, the transformers engine's completions replayed exactly, and the
check's verdicts on hand-made dishonest completions."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from rollout_helpers import byte_tokenizer, save_tiny_model

from pulseloco.errors import ConfigError
from pulseloco.integrations.rollout import TransformersEngine
from pulseloco.integrations.verify import LeaseCheck, RolloutVerifier, VerifyConfig
from pulseloco.rollouts import sampling
from pulseloco.rollouts.client import GroupResult
from pulseloco.rollouts.sampling import check_completions, choose, gumbel_noise

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


def results_of(completions: list, prompts: list[list[int]], samples: int, seed: int) -> list[GroupResult]:
    out = []
    for g in range(len(prompts)):
        mine = completions[g * samples : (g + 1) * samples]
        out.append(
            GroupResult(
                0, "d", [c.token_ids for c in mine], [c.logprobs for c in mine], "w", "lease", seed, g * samples
            )
        )
    return out


PROMPTS = [[10, 20, 30], [40, 50], [7, 8, 9, 10, 11]]


def check_lease(
    verifier: RolloutVerifier, model: torch.nn.Module, completions: list, samples: int, lag: int = 0
) -> LeaseCheck:
    """``verifier`` on one lease: ``samples`` completions of each of :data:`PROMPTS` (seed 5), 16 tokens at most."""
    eos = byte_tokenizer().eos_token_id
    return verifier.check(
        model,
        PROMPTS,
        results_of(completions, PROMPTS, samples, 5),
        [lag] * len(PROMPTS),
        temperature=1.0,
        max_new_tokens=16,
        stop_ids={eos},
    )["lease"]


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
    verifier = RolloutVerifier(VerifyConfig(verify_margin=0.0, verify_max_logprob_error=0.02), record_gaps=True)
    lease = check_lease(verifier, engine.model, got, 4)
    assert lease.reason is None and lease.mismatches == 0 and lease.checked == sum(len(c.token_ids) for c in got)
    assert verifier.gaps is not None and max(verifier.gaps) == 0.0


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


def test_the_check_fails_each_kind_of_dishonest_completion(engine: TransformersEngine) -> None:
    """Hand-made lies, one lease each: a token that is not the sampler's choice, another seed's samples (a
    cherry-picker's), log-probabilities lowered by 1 nat, a completion cut short without EOS; the honest lease
    passes. A mismatch inside the margin is counted as near, not failed."""
    repeated = [p for p in PROMPTS for _ in range(4)]
    honest = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    other_seed = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=6)

    def check(completions: list, margin: float = 0.5) -> str | None:
        return check_lease(RolloutVerifier(VerifyConfig(verify_margin=margin)), engine.model, completions, 4).reason

    assert check(honest) is None
    flipped = list(honest)
    c = flipped[3]
    flipped[3] = type(c)([*c.token_ids[:2], (c.token_ids[2] + 1) % 256, *c.token_ids[3:]], c.logprobs)
    assert "not the replayable sampler's choice" in str(check(flipped))
    assert "not the replayable sampler's choice" in str(check(other_seed))
    forged = [type(c)(c.token_ids, [lp - 1.0 for lp in c.logprobs]) for c in honest]
    assert "log-probabilities differ from the trainer's by 1.000" in str(check(forged))
    cut = [type(c)(c.token_ids[:3], c.logprobs[:3]) if i == 0 else c for i, c in enumerate(honest)]
    assert "stopped before max_new_tokens without an end-of-sequence token" in str(check(cut))
    assert check(flipped, margin=1e6) is None  # inside the margin: a near miss, not a failure


def test_check_completions_counts_gaps_against_a_per_completion_margin() -> None:
    """``check_completions`` directly: the second completion's token trails by a known gap; a margin per completion
    decides mismatch or near; unchecked positions are not counted."""
    vocab = 8
    logits = torch.zeros((2, 3, vocab))
    seeds, sequences = torch.tensor([1, 1]), torch.tensor([0, 1])
    noise = gumbel_noise(seeds.unsqueeze(1).expand(2, 3), sequences.unsqueeze(1), torch.arange(3), vocab)
    tokens = noise.argmax(-1)
    second = noise[1, 0].topk(2)
    tokens[1, 0] = second.indices[1]  # the runner-up: trails by this gap
    gap = (second.values[0] - second.values[1]).item()
    logprobs = torch.full((2, 3), -math.log(vocab))
    mask = torch.ones((2, 3))
    common = {"temperature": 1.0, "seeds": seeds, "sequences": sequences}
    strict = check_completions(logits, tokens, mask, logprobs, margin=torch.tensor([0.0, gap / 2]), **common)
    assert (strict[0].mismatches, strict[1].mismatches, strict[1].near) == (0, 1, 0)
    assert strict[1].worst_gap == pytest.approx(gap) and strict[1].logprob_error < 1e-6
    loose = check_completions(logits, tokens, mask, logprobs, margin=gap * 2, **common)
    assert (loose[1].mismatches, loose[1].near) == (0, 1)
    skip = torch.ones((2, 3), dtype=torch.bool)
    skip[1, 0] = False
    unchecked = check_completions(logits, tokens, mask, logprobs, margin=0.0, check=skip, **common)
    assert unchecked[1].mismatches == 0 and unchecked[1].checked == 2


def test_shared_prompts_give_the_logits_of_a_whole_forward_pass(engine: TransformersEngine) -> None:
    """The check runs each distinct prompt once and its completions on the prompt's KV cache: the logits that predict
    every completion token are those of one forward pass over prompt and completion (FP32, to rounding), for
    prompts of several lengths, repeated prompts, and completions of 0, 1 and more tokens."""
    model = copy.deepcopy(engine.model).float()
    rows = [
        (PROMPTS[0], [5, 6, 7]),
        (PROMPTS[0], [9]),
        (PROMPTS[1], [3, 4]),
        (PROMPTS[2], []),
        (PROMPTS[1], [8, 2, 1, 4]),
    ]
    chunk = [("lease", list(p), c, [0.0] * len(c), 5, i) for i, (p, c) in enumerate(rows)]
    with torch.no_grad():
        got = RolloutVerifier._completion_logits(model, chunk, 4)
    assert got.shape == (5, 4, model.config.vocab_size)
    with torch.no_grad():
        for i, (prompt, completion) in enumerate(rows):
            whole = model(input_ids=torch.tensor([prompt + completion])).logits[0]
            expected = whole[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
            assert torch.allclose(got[i, : len(completion)], expected, atol=1e-5), i


def test_verifier_settings_are_checked() -> None:
    for name, bad in (
        ("verify_margin", -1.0),
        ("verify_margin", float("nan")),
        ("verify_max_mismatch_rate", 1.0),
        ("verify_max_logprob_error", 0.0),
        ("verify_fraction", 0.0),
    ):
        with pytest.raises(ConfigError, match=name):
            VerifyConfig(**{name: bad})


def test_a_random_fraction_of_completions_is_checked(engine: TransformersEngine) -> None:
    """``fraction`` < 1 checks a random share of each lease's completions (at least one), drawn by the trainer; a
    lease whose every completion is another seed's still fails. (With ``verify_weights="version"``: the shared
    check looks at every completion, since its forward pass is TRL's.)"""
    repeated = [p for p in PROMPTS for _ in range(8)]
    got = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    verifier = RolloutVerifier(VerifyConfig(verify_fraction=0.25, verify_weights="version"), seed=3)
    lease = check_lease(verifier, engine.model, got, 8)
    lengths = sorted(len(c.token_ids) for c in got)
    assert lease.reason is None and lease.completions == 24
    assert sum(lengths[:6]) <= lease.checked <= sum(lengths[-6:])  # six of the 24 completions
    other = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=6)
    tiny = RolloutVerifier(VerifyConfig(verify_fraction=0.01, verify_weights="version"), seed=3)
    failed = check_lease(tiny, engine.model, other, 8)
    assert failed.checked <= 16 and "not the replayable sampler's choice" in str(failed.reason)


def test_a_lease_is_checked_with_its_versions_weights_even_when_the_trainer_wraps_forward(
    engine: TransformersEngine,
) -> None:
    """The trainer has moved on from the version the worker sampled with, and its ``forward`` is wrapped in a
    closure over the module (as ``accelerate`` wraps it for autocast): the check builds its own model from the
    config and loads the held version into it, so it passes with a margin that covers BF16 rounding only, where
    checking with the trainer's weights fails."""
    from pulseloco.integrations.verify import VersionStates

    published = {n: t.detach().to(torch.bfloat16).clone() for n, t in engine.model.state_dict().items()}
    states = VersionStates(None, "run.policy", None, {}, keep=2)
    states.add(0, published)
    trainer = copy.deepcopy(engine.model).float()
    original = trainer.forward
    trainer.forward = lambda *args, **kwargs: original(*args, **kwargs)  # a closure over the original module
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    repeated = [p for p in PROMPTS for _ in range(4)]
    got = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    pinned = RolloutVerifier(VerifyConfig(verify_margin=0.1), states=states, states_wait=0.0)
    lease = check_lease(pinned, trainer, got, 4, lag=1)
    assert lease.pinned and lease.reason is None, lease
    trainers = check_lease(RolloutVerifier(VerifyConfig(verify_margin=0.1)), trainer, got, 4)
    assert "not the replayable sampler's choice" in str(trainers.reason)
    assert states.wait(7, timeout=0.0) is None and states.versions() == [0]


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
    """``verify_weights="shared"`` (the default): every completion is checked first with the trainer's current
    weights; where they are the version's (FP32 holding the BF16 values) every completion passes there, no version
    is looked up, and the check's log-probabilities answer TRL's importance-sampling forward pass for TRL's batch
    (equal to what TRL computes; ``None`` for a batch with a row the check never saw). Where the trainer has moved
    on, the completions that fail the first check are checked again with the version's weights and pass; TRL still
    gets the trainer's current log-probabilities. Tokens of another seed fail both checks."""
    from pulseloco.integrations.verify import VersionStates

    repeated = [p for p in PROMPTS for _ in range(4)]
    got = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=5)
    published = {n: t.detach().to(torch.bfloat16).clone() for n, t in engine.model.state_dict().items()}
    states = VersionStates(None, "run.policy", None, {}, keep=2)
    states.add(0, published)
    trainer = copy.deepcopy(engine.model).float()  # the trainer's FP32 weights holding the version's BF16 values

    verifier = RolloutVerifier(VerifyConfig(verify_margin=0.1), states=states, states_wait=0.0)
    lease = check_lease(verifier, trainer, got, 4, lag=1)
    assert lease.reason is None and lease.shared == lease.completions == 12 and not lease.pinned, lease
    assert verifier.stats.shared_completions == 12 and verifier.stats.pinned_leases == 0
    ids, mask, keep, trl = trl_logps(trainer, repeated, got, 1.0)
    shared = verifier.shared_logps(ids, mask, int(keep))
    real = mask[:, -int(keep) :].bool()
    assert shared is not None and shared.shape == trl.shape
    assert torch.allclose(shared[real], trl[real], atol=1e-4) and not shared[~real].any()
    mask[0, ids.shape[1] - int(keep) - 1] = 0  # a prompt the check never saw
    assert verifier.shared_logps(ids, mask, int(keep)) is None
    verifier.clear_shared()
    assert verifier.shared_logps(ids, torch.ones_like(ids), int(keep)) is None

    moved = copy.deepcopy(trainer)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in moved.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    verifier = RolloutVerifier(VerifyConfig(verify_margin=0.1), states=states, states_wait=0.0)
    lease = check_lease(verifier, moved, got, 4, lag=1)
    assert lease.reason is None and lease.pinned and lease.shared < lease.completions, lease
    ids, mask, keep, trl = trl_logps(moved, repeated, got, 1.0)
    shared = verifier.shared_logps(ids, mask, int(keep))
    assert shared is not None and torch.allclose(shared[real], trl[real], atol=1e-4)

    other = engine.generate_ids(repeated, max_new_tokens=16, temperature=1.0, seed=6)  # claimed as seed 5's
    verifier = RolloutVerifier(VerifyConfig(), states=states, states_wait=0.0)
    lease = check_lease(verifier, trainer, other, 4, lag=1)
    assert lease.pinned and "not the replayable sampler's choice" in str(lease.reason), lease
