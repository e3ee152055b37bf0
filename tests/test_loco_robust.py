"""pulseloco.loco.robust and its use by the owner, the member and the sender, on hand-checked tensors (no swarm).

The owner's sum (``ShardOwner._sum_contributions``) clips each part to the median norm and reports the scales; the
member checks the scales it receives (``SparseAverager._average_shards``); the sender returns what was clipped off
to its residual (``PulseLoCo._average``) and its ledger follows an adopted state's scales (``Ledger.reconcile``).
A real group with a Byzantine peer: tests/test_loco_swarm.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pulseloco.errors import ConfigError, PayloadError
from pulseloco.loco import AveragingConfig, PulseLoCo, RoundConfig
from pulseloco.loco.averaging import AllReduceResult, SparseAverager, shard_bounds
from pulseloco.loco.ledger import Ledger, LedgerEntry
from pulseloco.loco.matchmaking import Group
from pulseloco.loco.robust import RepeatOutliers, clip_split, parse_scales
from pulseloco.loco.shard_owner import AGGREGATE_NAME, CONTRIBUTION_NAME, ShardOwner, ShardSum
from pulseloco.loco.validation import decode_sparse, encode_sparse

NUMEL = 6


class _Owner(ShardOwner):
    """The owner's summing, without a network (``_sum_contributions`` is pure CPU work)."""

    def __init__(self, peer_id: str, *, clip_to_median: bool = True, dispute_rounds: int = 8) -> None:
        self.numel, self.peer_id, self.max_norm_ratio = NUMEL, peer_id, 10.0
        self.clip_to_median, self.dispute_norm_ratio = clip_to_median, 4.0
        self.repeat_outliers = RepeatOutliers(dispute_rounds)

    def sum(self, parts: dict[str, tuple[list[int], list[float]]], round_index: int = 0) -> ShardSum:
        frames = {
            peer: encode_sparse(CONTRIBUTION_NAME, NUMEL, torch.tensor(i), torch.tensor(v), round_index=round_index)
            for peer, (i, v) in parts.items()
        }
        return self._sum_contributions(round_index, NUMEL, frames)


def _sum_of(summed: ShardSum) -> dict[int, float]:
    indices_K, sum_K = decode_sparse(summed.payload, AGGREGATE_NAME, NUMEL)
    return dict(zip(indices_K.tolist(), sum_K.tolist()))


# Norms 5, 3, 10 and 40 (d: a's direction sign-flipped at 8x): median 7.5, so c is scaled by 0.75 and d by 0.1875;
# d is under the outlier screen (10x the others' median, 5) but strikes (above 4x the median).
PARTS = {
    "a": ([0, 1], [3.0, 4.0]),
    "b": ([1], [3.0]),
    "c": ([3], [10.0]),
    "d": ([0, 1], [-24.0, -32.0]),
}


def test_parts_are_clipped_to_the_median_norm_and_the_scales_reported() -> None:
    summed = _Owner("a").sum(PARTS)
    assert summed.header["accepted"] == ["a", "b", "c", "d"]
    assert summed.header["scales"] == [1.0, 1.0, 0.75, 0.1875]
    assert summed.header["rejected"] == [] and summed.num_rejected == 0
    # 3 - 24 * 0.1875, 4 + 3 - 32 * 0.1875, 10 * 0.75: the sign-flipped part subtracts one median-sized vector
    assert _sum_of(summed) == {0: -1.5, 1: 1.0, 3: 7.5}
    assert summed.largest_norm_ratio == pytest.approx(40 / 7.5)
    # The screen alone lets the attack through whole, and it reverses the honest sum (3 + 4 + ... -> -21, -25).
    assert _sum_of(_Owner("a", clip_to_median=False).sum(PARTS)) == {0: -21.0, 1: -25.0, 3: 10.0}


def test_without_a_majority_the_bar_is_the_owners_own_part_and_a_zero_bar_clips_nothing() -> None:
    pair = {"a": ([0, 1], [3.0, 4.0]), "d": ([0, 1], [-24.0, -32.0])}
    summed = _Owner("a").sum(pair)  # d is 8x a (under the 10x screen): clipped to a's norm, 1/8
    assert summed.header["scales"] == [1.0, 0.125] and _sum_of(summed) == {0: 0.0, 1: 0.0}
    assert _Owner("x").sum(pair).header["scales"] == [1.0, 1.0]  # no part of its own: no bar
    lone = {"a": ([], []), "b": ([], []), "c": ([], []), "d": ([2], [5.0])}
    assert _Owner("a").sum(lone).header["scales"] == [1.0, 1.0, 1.0, 1.0]  # median 0: a lone sender is not held


def test_clip_split_halves_add_up_to_the_values_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4096, generator=gen) * torch.logspace(-40, 30, 4096)
    values = torch.cat([values, torch.tensor([0.0, -0.0, 1e-45, -3e-45, 3.0e38])])
    for scale in (1.0, 0.75, 0.5, 0.5000001, 0.49999997, 0.1875, 1 / 3, 1e-3, 1e-30, 0.0):
        scale = float(torch.tensor(scale, dtype=torch.float32))
        kept, clipped = clip_split(values, scale)
        assert torch.all((kept + clipped) == values)  # exactly (bitwise but for -0.0 + 0.0, which is +0.0)
        if scale >= 0.5:
            assert torch.equal(kept, values * torch.tensor(scale))
        # below 1/2 the returned part is rounded on the values' own grid: kept is off by up to an ulp of the value
        assert torch.all((kept - values.double() * scale).abs() <= values.abs().double() * 2.0**-23 + 1e-45)
    with pytest.raises(ValueError, match="scale"):
        clip_split(values, 0.1)  # not an FP32 number: the two sides could round it differently
    with pytest.raises(ValueError, match="scale"):
        clip_split(values, 1.5)


class _FakeMatchmaker:
    matchmaking_time = 1.0

    def form_group(self, round_index: int, expiration: float, digest: str) -> Group:
        return Group(round=round_index, members=("b", "me"), servers=("b", "me", "z"))


class _FakeAverager:
    """Answers ``all_reduce`` with a fixed verdict: shard 0 counted at 0.75, shard 1 at 0.3 (below 1/2: the other
    branch of clip_split), shard 2 not counted (its sum was not fetched)."""

    peer_id = "me"
    averaging_timeout = 1.0

    def all_reduce(
        self, group: Group, indices_K: torch.Tensor, values_K: torch.Tensor, _: str, __: torch.Tensor | None = None
    ) -> AllReduceResult:
        bounds = shard_bounds(15, 3)
        returned_K = indices_K >= bounds[2][0]
        return AllReduceResult(
            group=group,
            indices_K=torch.zeros(0, dtype=torch.int64),
            average_K=torch.zeros(0),
            returned_K=returned_K,
            complete=False,
            live_peers=frozenset({"me"}),
            num_rejected=0,
            bytes_sent=0,
            bytes_received=0,
            accepted=(("b", "me"), ("b", "me"), None),
            scales=((1.0, 0.75), (1.0, float(torch.tensor(0.3))), None),
            bounds=tuple(bounds),
        )


def test_the_sender_keeps_exactly_what_was_clipped_and_follows_an_adopted_ledger() -> None:
    """sent-and-counted + residual == signal, bit for bit, after the owners' clipping; and again after the ledger
    of an adopted state says otherwise (shard 0 not counted, shard 2 counted at 1/2)."""
    torch.manual_seed(0)
    opt = PulseLoCo(torch.nn.Linear(4, 3), None, round_config=RoundConfig(selector="dense"))
    opt.averager, opt.matchmaker = _FakeAverager(), _FakeMatchmaker()  # type: ignore[assignment]
    opt.ledger = Ledger("me")
    signal_N = torch.randn(15) * 1e-2
    opt.residual_N.copy_(signal_N)
    result, _, _, values_K, _ = opt._average()
    assert result is not None and torch.equal(values_K, signal_N) and opt._num_clipped == 10

    def check(scales: list[float | None]) -> None:
        counted_N = torch.zeros(15)
        for (start, stop), scale in zip(shard_bounds(15, 3), scales):
            if scale is not None:
                counted_N[start:stop] = clip_split(signal_N[start:stop], scale)[0]
        assert torch.equal(counted_N + opt.residual_N, signal_N)

    check([0.75, float(torch.tensor(0.3)), None])
    pending = opt.ledger.pending[0]
    assert pending.counted == [True, True, False] and pending.scales == [0.75, float(torch.tensor(0.3)), 1.0]
    group = opt.ledger.entries[0].group
    scales = [[1.0], [1.0, float(torch.tensor(0.3))], [0.5]]
    adopted = Ledger.parse({"0": {"group": group, "accepted": [["b"], ["b", "me"], ["me"]], "scales": scales}})
    assert adopted[0] == LedgerEntry(group, (("b",), ("b", "me"), ("me",)), tuple(map(tuple, scales)))
    assert opt.ledger.reconcile(adopted, 1, opt.residual_N) == 10
    check([None, float(torch.tensor(0.3)), 0.5])
    assert opt.ledger.reconcile(adopted, 1, opt.residual_N) == 0  # idempotent


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        (None, "lacks"),
        ([1.0], "1 clip scales for 2"),
        ([1.0, True], "not a number"),
        ([1.0, "0.5"], "not a number"),
        ([1.0, 0.0], r"in \(0, 1\]"),
        ([1.0, 1.5], r"in \(0, 1\]"),
        ([1.0, float("nan")], r"in \(0, 1\]"),
        ([1.0, float("inf")], r"in \(0, 1\]"),
        ([1.0, 0.1], "not an FP32 number"),
    ],
)
def test_bad_clip_scales_are_refused_with_a_clear_error(scales: Any, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        parse_scales(scales, ["a", "b"])
    ledger = Ledger("me")
    entry = {"group": "g", "accepted": [["a", "b"]], "scales": [scales]}
    with pytest.raises(PayloadError):
        ledger.reconcile(Ledger.parse({"3": entry}), 4, torch.zeros(3))
    assert ledger.entries == {} and ledger.pending == {}


def test_a_member_refuses_a_sum_with_a_bad_scale_and_applies_nothing_of_it() -> None:
    """The member side: a shard whose header carries a bad scale is not applied (the sender's part of it goes back
    to its residual, as for a missing sum); the well-formed shard is."""
    member = object.__new__(SparseAverager)  # only the checks of _average_shards: no network
    member.peer_id, member.max_norm_ratio, member.disputed = "b", 10.0, set()
    group = Group(round=0, members=("a", "b", "c", "d"), servers=("a", "b"))
    good = _Owner("a").sum(PARTS)
    bad = _Owner("b").sum(PARTS)
    bad.header["scales"][3] = 2.0
    bounds = [(0, NUMEL), (NUMEL, 2 * NUMEL)]
    results: list[tuple[dict[str, Any], bytes] | None] = [(good.header, good.payload), (bad.header, bad.payload)]
    indices, averages, accepted, scales, _, _ = member._average_shards(group, bounds, results, [3.0, 3.0], [b"", b""])
    assert accepted == [("a", "b", "c", "d"), None] and scales == [(1.0, 1.0, 0.75, 0.1875), None]
    assert len(indices) == 1 and indices[0].tolist() == [0, 1, 3]
    assert averages[0].tolist() == [-1.5 / 4, 1.0 / 4, 7.5 / 4]
    assert member.disputed == set()


def test_a_peer_striking_in_most_rounds_is_excluded_and_an_honest_one_is_not() -> None:
    outliers = RepeatOutliers(8)
    assert outliers.num_strikes == 5
    for r in range(4):
        assert outliers.record(r, {"x": "9x", "h": "4.1x" if r % 2 else None}) == {}
    newly = outliers.record(4, {"x": "9x", "h": None})
    assert list(newly) == ["x"] and "struck in 5 of its last 5 rounds" in newly["x"]
    for r in range(5, 200):  # strikes in every other round: never a majority
        outliers.record(r, {"x": None, "h": "4.1x" if r % 2 else None})
    assert outliers.excluded().keys() == {"x"} and outliers.exclusion("h") is None
    never = RepeatOutliers(0)
    for r in range(20):
        assert never.record(r, {"x": "9x"}) == {}
    assert never.excluded() == {}


def test_an_owner_excludes_a_repeat_outlier_and_never_an_honest_peer() -> None:
    """Fifty rounds of three honest parts in random directions with norms spread over a factor of two, and an
    attacker sending a's part sign-flipped at 8x: it strikes every round (clipped hard, or refused by the screen),
    so from round 5 on every part of it is refused as excluded; no honest part is ever refused."""
    owner = _Owner("a")
    gen = torch.Generator().manual_seed(1)
    for r in range(50):
        honest = {}
        for peer in ("a", "b", "c"):
            direction = torch.randn(3, generator=gen)
            honest[peer] = direction / direction.norm() * (1 + float(torch.rand(1, generator=gen)))
        parts = {peer: ([0, 1, 2], values.tolist()) for peer, values in honest.items()}
        summed = owner.sum({**parts, "d": ([0, 1, 2], (-8 * honest["a"]).tolist())}, round_index=r)
        assert set(summed.header["accepted"]) >= {"a", "b", "c"}
        assert (owner.repeat_outliers.exclusion("d") is not None) == (r >= 4)
        if r >= 5:
            assert "d" in summed.header["rejected"] and "d" not in summed.header["accepted"]
    assert owner.repeat_outliers.excluded().keys() == {"d"}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dispute_norm_ratio": 1.0}, "dispute_norm_ratio"),
        ({"dispute_norm_ratio": float("inf")}, "dispute_norm_ratio"),
        ({"dispute_rounds": -1}, "dispute_rounds"),
        ({"dispute_rounds": 2.5}, "dispute_rounds"),
        ({"clip_to_median": "yes"}, "clip_to_median"),
    ],
)
def test_bad_robust_aggregation_settings_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        AveragingConfig(**kwargs)
