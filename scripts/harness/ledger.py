"""An outside ledger of a PULSELoCo swarm's contributions, for the exactly-once checks of the tests and the WAN
swarm (experiments/wan): what every peer produced, what each of its own rounds applied to ``theta``, and what it
still holds, so that ``produced = counted by the final theta's lineage + held in the residuals`` can be checked
exactly across peers.

    report: dict = {}
    record(opt, report)            # in the peer's process, before its first round (instruments ``opt``)
    ...                            # train; at the end add report["theta"] and report["residual"] (FP32 bytes)
    conservation_error(reports)    # anywhere: the relative error over the swarm's reports

The vectors are plain FP32 bytes (``tensor.numpy().tobytes()``), so reports cross process boundaries as pickles or
files. :func:`record` wraps private methods of one ``PulseLoCo`` (and the outer optimizer's class, in that process
only): a harness for tests and experiments, not library code.
"""

from __future__ import annotations

from typing import Any

import torch


def record(opt: Any, report: dict[str, Any]) -> None:
    """Record into ``report``: ``produced`` (every pseudo-gradient this peer produced, summed), ``transitions``
    (per own outer step: digest before, digest after, and the sum of contributions applied: the average times the
    number of contributions each shard counted) and ``initial_digest``. Downloads change no sums, so walking the
    transitions back from a final digest gives what that theta's lineage counted. Needs ``opt.averager``."""
    from pulseloco.loco.outer import NesterovOuterOptimizer
    from pulseloco.loco.validation import theta_digest

    produced = torch.zeros(opt.numel)
    report["transitions"] = []
    report["initial_digest"] = theta_digest(opt.theta_N)
    report["produced"] = produced.numpy().tobytes()
    add_pseudo_gradient, all_reduce = opt._add_pseudo_gradient, opt.averager.all_reduce
    outer_step = NesterovOuterOptimizer.step_sparse
    last_sum: list[torch.Tensor] = []

    def add_and_record(chunks: Any) -> None:
        chunks = None if chunks is None else [(lo, hi, chunk.clone()) for lo, hi, chunk in chunks]
        for lo, hi, chunk in chunks or []:
            produced[lo:hi] += chunk
        report["produced"] = produced.numpy().tobytes()
        add_pseudo_gradient(None if chunks is None else iter(chunks))

    def all_reduce_and_record(group: Any, indices_K: torch.Tensor, values_K: torch.Tensor, *args: Any) -> Any:
        result = all_reduce(group, indices_K, values_K, *args)
        sum_N = torch.zeros(opt.numel)
        sum_N[result.indices_K] = result.average_K
        for (start, stop), names in zip(result.bounds, result.accepted):
            sum_N[start:stop] *= len(names) if names else 0
        last_sum[:] = [sum_N]
        return result

    def step_and_record(self: Any, theta_N: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        before = theta_digest(theta_N)
        outer_step(self, theta_N, *args, **kwargs)
        applied = last_sum.pop() if last_sum else torch.zeros(opt.numel)
        report["transitions"].append((before, theta_digest(theta_N), applied.numpy().tobytes()))

    opt._add_pseudo_gradient = add_and_record
    opt.averager.all_reduce = all_reduce_and_record
    NesterovOuterOptimizer.step_sparse = step_and_record  # type: ignore[method-assign]  (this process only)


def vector(report: dict[str, Any], key: str) -> torch.Tensor:
    """``report[key]`` (FP32 bytes) as a tensor."""
    return torch.frombuffer(bytearray(report[key]), dtype=torch.float32)


def conservation_error(reports: list[dict[str, Any]], theta: bytes | None = None) -> float:
    """Relative error of the exact ledger: everything the peers produced equals what the rounds of the final
    ``theta``'s lineage counted plus what the peers still hold in their residuals (``theta``: FP32 bytes, default
    the first report's). A contribution counted twice (applied by the others and also kept by its sender) or lost
    shows up at the size of its values. Raises ``ValueError`` when the reports do not share one initial theta or
    the final theta was made by no recorded round (a peer's report is missing)."""
    from pulseloco.loco.validation import theta_digest

    steps = {after: (before, applied) for r in reports for before, after, applied in r["transitions"]}
    initial = {r["initial_digest"] for r in reports}
    if len(initial) != 1:
        raise ValueError(f"the peers started from {len(initial)} different thetas")
    final = torch.frombuffer(bytearray(theta if theta is not None else reports[0]["theta"]), dtype=torch.float32)
    digest = theta_digest(final)
    applied = torch.zeros_like(final)
    for _ in range(100_000):
        if digest in initial:
            break
        if digest not in steps:
            raise ValueError(f"theta digest {digest} was made by no recorded round (a peer's report is missing?)")
        digest, applied_bytes = steps[digest]
        applied += torch.frombuffer(bytearray(applied_bytes), dtype=torch.float32)
    produced = sum(vector(r, "produced") for r in reports)
    held = sum(vector(r, "residual") for r in reports)
    assert isinstance(produced, torch.Tensor)  # noqa: S101 (reports is not empty: it has an initial digest)
    return float(torch.linalg.vector_norm(produced - applied - held) / torch.linalg.vector_norm(produced))
