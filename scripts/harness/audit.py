"""The outside ledger of a swarm of PULSELoCo processes (the churn soak, ``experiments/soak/soak.py``, and the WAN
swarm, ``experiments/wan/swarm.py``), both ends: what every peer process records as it trains (:class:`Audit`,
hooked into its PulseLoCo optimizer) and the exactly-once check the supervisor runs over those records at the end
(:func:`check_ledger`).

The files under the run's folder: ``prod/<peer id>.<round>.npy`` (pseudo-gradients produced),
``sent/<peer id>.<round>.npy`` (dense contributions pushed), ``resid/<name>.npy`` (the last residual),
``ids/<name>`` (a process's peer id) and ``<name>.jsonl`` (one record per finished round). A SIGKILLed peer loses
nothing it already wrote. Writing raises OSError (the peer process then fails); the check never raises for a broken
lineage, it says why in its ``note``.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

LEDGER_TOLERANCE = 1e-5
"""Relative tolerance of the ledger check (FP32 sums over a few hundred contributions)."""


class Audit:
    """The outside ledger of one peer process, written as it goes (a SIGKILL loses nothing already written).

    - ``prod/<peer>.<round>.npy``: the pseudo-gradient produced before the round (written before anything is sent;
      keyed by the round the peer was at, which is below the round it is sent in when the peer catches up first);
    - ``sent/<peer>.<round>.npy``: the dense contribution pushed in the round (written before it is pushed);
    - ``<name>.jsonl``: one record per finished round: group, accepted lists and shard bounds, the theta digests
      before and after the outer step (a transition) and at the end, metrics, downloads, when the round applied
      its step (``t_applied``);
    - ``resid/<name>.npy``: the residual after the last round (rewritten every round);
    - ``resid/<name>.push.<round>.npy``: the residual left when the last contribution was pushed (the selection
      taken out), so that a process killed mid-round is checked against all it held.

    What a round's hooks record is kept under its round index until :meth:`end_round` writes it, so rounds that
    run in the background (``RoundConfig.overlap``: the hooks run on the optimizer's thread while the next inner
    steps run, and the round lands a round later) are recorded as they land; call :meth:`end_round` from a round
    listener (``PulseLoCo.add_round_listener``) or after each blocking round.
    """

    def __init__(self, opt: Any, out: Path, name: str) -> None:
        """Hook the recording into ``opt`` (a PulseLoCo optimizer) and the outer optimizer's class; ``name`` is the
        process's ``peer<i>.<incarnation>``. Raises OSError when ``out`` cannot be written."""
        from pulseloco.loco.outer import NesterovOuterOptimizer
        from pulseloco.loco.validation import theta_digest

        self.opt, self.out, self.name = opt, out, name
        self.peer_id = str(opt.peer_id)
        self.downloads = 0
        self.rounds: dict[int, dict[str, Any]] = collections.defaultdict(dict)  # by round index, until written
        for sub in ("prod", "sent", "resid", "ids"):
            (out / sub).mkdir(exist_ok=True)
        (out / "ids" / name).write_text(self.peer_id)
        add_pseudo_gradient, all_reduce = opt._add_pseudo_gradient, opt.averager.all_reduce
        download = opt.averager.download_state
        form_group = opt.matchmaker.form_group
        outer_step = NesterovOuterOptimizer.step_sparse

        is_finite = opt._pseudo_gradient_is_finite
        round_started: list[int] = []

        def is_finite_and_record(base_N: torch.Tensor) -> bool:
            round_started[:] = [opt.round]  # before the catch-up, which may move the round
            return is_finite(base_N)

        def add_and_record(chunks: Any) -> None:
            chunks = None if chunks is None else [(lo, hi, chunk.clone()) for lo, hi, chunk in chunks]
            produced = torch.zeros(opt.numel)
            for lo, hi, chunk in chunks or []:
                produced[lo:hi] = chunk
            np.save(self.out / "prod" / f"{self.peer_id}.{round_started[0]}.npy", produced.numpy())
            add_pseudo_gradient(None if chunks is None else iter(chunks))

        def form_group_and_record(round_index: int, *args: Any) -> Any:
            self.rounds[round_index]["start"] = theta_digest(opt.theta_N)  # after the repair at the round's start
            return form_group(round_index, *args)

        def all_reduce_and_record(group: Any, indices_K: torch.Tensor, values_K: torch.Tensor, *args: Any) -> Any:
            sent = torch.zeros(opt.numel)
            sent[indices_K] = values_K
            # what stays behind when this contribution goes (the residual after the selection), then the sent part:
            # a process killed after this holds both, whatever the owners counted
            push = self.out / "resid" / f"{self.name}.push.{group.round}.npy"
            np.save(push, opt.residual_N.numpy())
            for older in (self.out / "resid").glob(f"{self.name}.push.*.npy"):
                if older != push:
                    older.unlink()
            np.save(self.out / "sent" / f"{self.peer_id}.{group.round}.npy", sent.numpy())
            result = all_reduce(group, indices_K, values_K, *args)
            self.rounds[group.round].update(
                group=group.group_id,
                members=list(group.members),
                accepted=[sorted(names) if names is not None else None for names in result.accepted],
                bars=list(result.bars),
                bounds=[list(b) for b in result.bounds],
            )
            return result

        def download_and_count(*args: Any, **kwargs: Any) -> Any:
            snapshot = download(*args, **kwargs)
            self.downloads += 1
            return snapshot

        def step_and_record(outer: Any, theta_N: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            before = theta_digest(theta_N)
            outer_step(outer, theta_N, *args, **kwargs)
            # opt.round is the round's index until the step is applied
            self.rounds[opt.round].update(transition=[before, theta_digest(theta_N)], t_applied=time.time())

        opt._pseudo_gradient_is_finite = is_finite_and_record
        opt._add_pseudo_gradient = add_and_record
        opt.matchmaker.form_group = form_group_and_record
        opt.averager.all_reduce = all_reduce_and_record
        opt.averager.download_state = download_and_count
        NesterovOuterOptimizer.step_sparse = step_and_record  # this process has one optimizer

    def end_round(self, final: bool = False, metrics: Any = None) -> None:
        """Write the round the optimizer just finished or landed (``metrics``, by default its ``last_metrics``)
        and, between blocking rounds, the residual (with overlap the next round is already changing it:
        :meth:`finish` writes it); ``final`` marks the process's last round."""
        m = metrics if metrics is not None else self.opt.last_metrics
        if not self.opt.overlap:
            np.save(self.out / "resid" / f"{self.name}.npy", self.opt.residual_N.numpy())
        current = self.rounds.pop(m.round, {})
        for older in [r for r in list(self.rounds) if r < m.round]:  # rounds that never ended (a repair skipped them)
            del self.rounds[older]
        record = {
            "name": self.name,
            "peer_id": self.peer_id,
            "round": m.round,
            # with overlap the next round may already have moved the counter (a repair as it starts)
            "end_round": m.round + 1 if self.opt.overlap else self.opt.round,
            "digest": m.theta_digest,
            "finite": bool(torch.isfinite(self.opt.theta_N).all()),
            "repaired": m.repaired,
            "complete": m.complete,
            "num_peers": m.num_peers,
            "num_contributors": m.num_contributors,
            "num_rejected": m.num_rejected,
            "num_reconciled": m.num_reconciled,
            "downloads": self.downloads,
            "final": final,
            "t": time.time(),
            **current,
        }
        with (self.out / f"{self.name}.jsonl").open("a") as fh:
            fh.write(json.dumps(record) + "\n")

    def finish(self) -> None:
        """Write the process's end: a ``final`` record of the theta it holds now (after a catch-up at the end, which
        may replace it or step back a round alone) and its residual; no round, so no transition."""
        from pulseloco.loco.validation import theta_digest

        np.save(self.out / "resid" / f"{self.name}.npy", self.opt.residual_N.numpy())
        record = {
            "name": self.name,
            "peer_id": self.peer_id,
            "end_round": self.opt.round,
            "digest": theta_digest(self.opt.theta_N),
            "finite": bool(torch.isfinite(self.opt.theta_N).all()),
            "downloads": self.downloads,
            "error_decay": self.opt.error_decay,
            "final": True,
            "t": time.time(),
        }
        with (self.out / f"{self.name}.jsonl").open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def lineage_counts(
    out: Path, transitions: dict[str, dict[str, Any]], digest: str, initial: str, max_steps: int
) -> dict[tuple[str, int], np.ndarray]:
    """What the lineage of ``digest`` counted of each contributor, per round: ``{(peer id, round): the entries of its
    contribution that the accepting shards summed, at the scales the owners' clip bars give its parts}``, walking
    ``transitions`` (keyed by the digest they lead to) back to ``initial``. Raises ValueError when the lineage breaks
    (an unknown digest, or more than ``max_steps`` steps) or an accepted contribution has no ``sent/`` record."""
    lineage = []
    while digest != initial:
        step = transitions.get(digest)
        if step is None or len(lineage) > max_steps:
            raise ValueError(f"lineage broken at digest {digest}")
        lineage.append(step)
        digest = step["transition"][0]
    from pulseloco.loco.robust import clip_scale, clip_split, part_norm

    counted: dict[tuple[str, int], np.ndarray] = {}
    for step in lineage:
        shard_bars = step.get("bars") or [None] * len(step["accepted"])
        for names, bar, (start, stop) in zip(step["accepted"], shard_bars, step["bounds"]):
            for name in names or []:
                sent_path = out / "sent" / f"{name}.{step['round']}.npy"
                if not sent_path.exists():
                    raise ValueError(f"an accepted contribution has no record: {sent_path.name}")
                sent = np.load(sent_path)
                part = torch.from_numpy(sent[start:stop])  # zeros off the selection add nothing to the norm
                kept = clip_split(part, clip_scale(part_norm(part), bar))[0]
                counted.setdefault((name, step["round"]), np.zeros_like(sent))[start:stop] = kept.numpy()
    return counted


def check_ledger(
    out: Path,
    records: list[dict[str, Any]],
    *,
    initial_digest: Callable[[], str],
    rounds: int,
    poisoner: str | None,
    notes: list[str],
) -> dict[str, Any]:
    """The exactly-once check (see ``experiments/soak/soak.py``'s docstring) over the :class:`Audit` files under ``out``
    and the peers' round ``records``. Transitions are keyed by the digest they lead to; a finished peer is checked
    against the lineage of the theta it holds, a killed one against the lineage of the theta most finished peers
    hold. Poisoned contributions (of the processes named ``<poisoner>.<incarnation>``; None: no poisoner) are counted
    in the latter.

    Returns ``{"violations", "max_error", "checked", "note", "poisoned"}``; a violation is also appended to
    ``notes``. Never raises for a broken lineage: ``note`` says why nothing was checked (also when no peer
    finished); ``initial_digest`` (the theta every lineage starts from) is called only when some peer finished."""
    transitions: dict[str, dict[str, Any]] = {}
    for r in records:
        if "transition" in r and r["transition"][0] != r["transition"][1]:
            transitions.setdefault(r["transition"][1], r)
    result: dict[str, Any] = {"violations": 0, "max_error": 0.0, "checked": 0, "note": "", "poisoned": 0}
    finals = collections.Counter(r["digest"] for r in records if r["final"])
    if not finals:
        result["note"] = "no peer finished"
        return result
    initial = initial_digest()
    lineages: dict[str, dict[tuple[str, int], np.ndarray]] = {}
    try:
        for digest in finals:
            lineages[digest] = lineage_counts(out, transitions, digest, initial, 10 * rounds)
    except ValueError as exc:
        result["note"] = str(exc)
        return result
    majority = lineages[finals.most_common(1)[0][0]]
    malicious = f"{poisoner}." if poisoner is not None else None
    peer_ids = {r["name"]: r["peer_id"] for r in records}
    if (out / "ids").is_dir():  # a process killed before it finished a round wrote no record, but its id
        peer_ids.update({p.name: p.read_text() for p in (out / "ids").iterdir() if p.name not in peer_ids})
    poisoners = {peer_id for name, peer_id in peer_ids.items() if malicious is not None and name.startswith(malicious)}
    result["poisoned"] = sum(1 for (name, _) in majority if name in poisoners)
    final_digest = {r["name"]: r["digest"] for r in records if r["final"]}
    total = sum(float(np.abs(np.load(p)).sum()) for p in (out / "prod").glob("*.npy")) or 1.0
    for name, peer_id in peer_ids.items():
        if malicious is not None and name.startswith(malicious):
            continue
        sent_rounds = sorted(int(p.name.split(".")[1]) for p in (out / "sent").glob(f"{peer_id}.*.npy"))
        prod = {int(p.name.split(".")[1]): np.load(p) for p in (out / "prod").glob(f"{peer_id}.*.npy")}
        if name in final_digest:  # all it produced, all its own theta's lineage counted of it
            held = np.load(out / "resid" / f"{name}.npy")
            counted, upto, skip = lineages[final_digest[name]], sys.maxsize, None
        elif sent_rounds:  # killed: its last contribution and what stayed behind when it went are what it held
            upto = sent_rounds[-1]
            held = np.load(out / "sent" / f"{peer_id}.{upto}.npy")
            push = out / "resid" / f"{name}.push.{upto}.npy"
            if push.exists():
                held = held + np.load(push)
            counted, skip = majority, upto
        else:
            continue
        produced = sum((v for r, v in prod.items() if r <= upto), np.zeros_like(held))
        applied = sum(
            (v for (n, r), v in counted.items() if n == peer_id and r != skip and r <= upto), np.zeros_like(held)
        )
        error = float(np.abs(produced - applied - held).sum()) / total
        result["checked"] += 1
        result["max_error"] = max(result["max_error"], error)
        if error > LEDGER_TOLERANCE:
            result["violations"] += 1
            notes.append(f"ledger: {name} off by {error:.3g} of the total")
    return result
