"""pulseloco.loco.ledger: the residual follows the theta a peer adopts, exactly (no swarm needed)."""

from __future__ import annotations

import pytest
import torch
from loco_helpers import pending

from pulseloco.errors import PayloadError
from pulseloco.loco.ledger import Ledger, LedgerEntry, Pending
from pulseloco.loco.validation import encode_parts


def _ledger_with_round(counted: list[bool]) -> tuple[Ledger, torch.Tensor]:
    """Peer "me" sent entries 1, 3 (shard 0: [0, 5)) and 6, 8 (shard 1: [5, 10)) in round 4 of group "g"; its
    residual holds what it returned (shards it believed not counted) plus an unrelated 0.5 at entry 0."""
    ledger = Ledger("me")
    indices_K, values_K = torch.tensor([1, 3, 6, 8]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    accepted = tuple(("me", "b") if c else ("b",) for c in counted)
    ledger.record(4, LedgerEntry("g", accepted), pending("g", indices_K, values_K, [(0, 5), (5, 10)], list(counted)))
    residual_N = torch.zeros(10)
    residual_N[0] = 0.5
    for shard, was_counted in enumerate(counted):
        if not was_counted:
            residual_N[indices_K[2 * shard : 2 * shard + 2]] = values_K[2 * shard : 2 * shard + 2]
    return ledger, residual_N


def test_a_part_the_adopted_state_counted_leaves_the_residual() -> None:
    ledger, residual_N = _ledger_with_round([True, False])  # shard 1 returned (its sum was not fetched)
    adopted = {4: LedgerEntry("g", (("b", "me"), ("b", "me")))}  # ...but the others counted it
    assert ledger.reconcile(adopted, 5, residual_N) == 2
    assert residual_N.tolist() == [0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0]


def test_a_part_the_adopted_state_lacks_returns_to_the_residual() -> None:
    ledger, residual_N = _ledger_with_round([True, True])  # a group of one: it counted everything itself
    adopted = {4: LedgerEntry("other-group", (("b", "c"),))}  # the majority's round did not include it
    assert ledger.reconcile(adopted, 5, residual_N) == 4
    assert residual_N.tolist() == [0.5, 1.0, 0, 2.0, 0, 0, 3.0, 0, 4.0, 0]
    assert ledger.entries == adopted  # the adopted lineage is this peer's now
    assert ledger.reconcile(adopted, 5, residual_N) == 0  # idempotent


def test_a_state_older_than_the_round_restores_the_round() -> None:
    ledger, residual_N = _ledger_with_round([True, True])
    assert ledger.reconcile({}, 4, residual_N) == 4  # the adopted theta predates round 4
    assert ledger.pending == {}


def test_a_round_outside_the_adopted_window_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    ledger, residual_N = _ledger_with_round([True, False])
    before = residual_N.clone()
    assert ledger.reconcile({5: LedgerEntry(None)}, 6, residual_N) == 0
    assert torch.equal(residual_N, before)
    assert "cannot reconcile round=4" in caplog.text


def test_old_rounds_are_forgotten_after_the_window() -> None:
    ledger = Ledger("me", keep_rounds=2)
    for r in range(5):
        ledger.record(r, LedgerEntry(None), None)
    assert sorted(ledger.entries) == [3, 4]


def _split(keep: int, swarm: str) -> tuple[Ledger, torch.Tensor]:
    """Peer "me" averaged rounds 0-9 in groups "a<r>" that counted its entry r (1.0 each); then it reconciles with
    a state of round 10 whose lineage ran groups "<swarm><r>" (served with the same window of ``keep`` rounds)."""
    ledger = Ledger("me", keep_rounds=keep)
    residual_N = torch.zeros(10)
    for r in range(10):
        ledger.record(
            r, LedgerEntry(f"a{r}", (("me",),)), pending(f"a{r}", torch.tensor([r]), torch.ones(1), [(0, 10)], [True])
        )
    accepted = (("me",),) if swarm == "a" else (("x",),)
    adopted = {r: LedgerEntry(f"{swarm}{r}", accepted) for r in range(max(0, 10 - keep), 10)}
    ledger.reconcile(adopted, 10, residual_N)
    return ledger, residual_N


def test_a_split_longer_than_the_window_is_logged_and_a_longer_window_reconciles_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # apart for 10 rounds with a window of 8: the rounds inside it come back to the residual, rounds 0 and 1 are
    # lost with the abandoned theta, and the peer says so
    _, residual_N = _split(8, "b")
    assert residual_N.tolist() == [0, 0] + [1.0] * 8
    assert "left this peer's at or before round=2" in caplog.text
    caplog.clear()
    # AveragingConfig.ledger_rounds = 16: the whole split is reconciled
    _, residual_N = _split(16, "b")
    assert residual_N.tolist() == [1.0] * 10 and "left this peer's" not in caplog.text
    # the same lineage (a peer that only fell behind): nothing to say
    _, residual_N = _split(8, "a")
    assert residual_N.tolist() == [0.0] * 10 and "left this peer's" not in caplog.text


def test_ledger_round_trips_through_json_and_rejects_malformed_input() -> None:
    ledger = Ledger("me")
    ledger.record(3, LedgerEntry("g", (("a", "me"), None)), None)
    assert Ledger.parse(ledger.to_json()) == ledger.entries
    for bad in ([], {"x": {}}, {"1": []}, {"1": {"group": 5}}, {"1": {"group": "g", "accepted": [[1]]}}):
        with pytest.raises(PayloadError):
            Ledger.parse(bad)


def test_a_contribution_is_kept_at_its_size_on_the_wire_and_decodes_exactly() -> None:
    """A dense FP32 contribution of 100,000 entries in two shards: the ledger keeps the parts as they were pushed
    (about 4 bytes an entry, not 12 of index and value tensors), and each shard decodes to exactly what was sent;
    a topk owner's kept set narrows the pending entries to those it kept."""
    generator = torch.Generator().manual_seed(0)
    indices_K = torch.arange(100_000)
    values_K = torch.randn(100_000, generator=generator) * 1e-3
    bounds = [(0, 60_000), (60_000, 100_000)]
    part = pending("g", indices_K, values_K, bounds, [True, True])
    assert sum(len(frame) for frame in part.parts) < 4.1 * 100_000
    for shard, (start, stop) in enumerate(bounds):
        got_indices, got_values = part.part(shard)
        assert torch.equal(got_indices, indices_K[start:stop]) and torch.equal(got_values, values_K[start:stop])
    part.kept[1] = torch.tensor([60_001, 99_999])
    got_indices, got_values = part.part(1)
    assert got_indices.tolist() == [60_001, 99_999] and torch.equal(got_values, values_K[[60_001, 99_999]])


def test_an_own_part_that_does_not_decode_is_left_in_the_residual(caplog: pytest.LogCaptureFixture) -> None:
    """A part this peer sent with a non-finite value (every owner refuses it with the same check, so no state counted
    it): a reconcile that would move it says so and leaves the residual alone instead of failing the round."""
    ledger = Ledger("me")
    bad = encode_parts(torch.tensor([1, 3]), torch.tensor([float("nan"), 1.0]), [(0, 5)], round_index=4)
    ledger.record(4, LedgerEntry("g", (("b",),)), Pending("g", bad, [(0, 5)], [False], norms=[1.0]))
    residual_N = torch.zeros(5)
    assert ledger.reconcile({4: LedgerEntry("g", (("b", "me"),))}, 5, residual_N) == 0
    assert torch.equal(residual_N, torch.zeros(5)) and "does not decode" in caplog.text
