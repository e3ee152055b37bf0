"""Helpers of the PULSELoCo tests: a tiny transformers model, deterministic data, and a swarm peer process.

The peer runs in a separate process (``spawn``) with its own hivemind DHT joined to the test's bootstrap DHT on
127.0.0.1; it trains for a number of rounds and reports its per-round digests, metrics and final state.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from harness import ledger, procs

VOCAB = 128
SEQ_LEN = 16
BATCH = 4


def pending(
    group: str,
    indices_K: torch.Tensor,
    values_K: torch.Tensor,
    bounds: list[tuple[int, int]],
    counted: list[bool],
    **fields: Any,
) -> Any:
    """A contribution as the optimizer records it in its ledger (:class:`pulseloco.loco.ledger.Pending`): the sorted
    global ``indices_K`` and ``values_K`` encoded as the parts pushed to the shards ``bounds``."""
    from pulseloco.loco.ledger import Pending
    from pulseloco.loco.validation import encode_parts

    return Pending(group, encode_parts(indices_K, values_K, bounds, round_index=0), bounds, counted, **fields)


def make_model(seed: int = 0) -> torch.nn.Module:
    """A two-layer Llama with hidden size 32 (about 40k parameters), built from a config, FP32."""
    from pulseloco.models import random_causal_lm

    return random_causal_lm(
        "llama", seed=seed, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False,
    )  # fmt: skip


def batch(peer_index: int, step: int) -> torch.Tensor:
    """Token ids for one inner step of one peer, a pure function of (peer, step)."""
    gen = torch.Generator().manual_seed(1_000_003 * (peer_index + 1) + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=gen)


def inner_step(model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    """Forward, backward and inner step (no zero_grad: the caller does it)."""
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return float(loss.detach())


def make_inner_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters() if p.requires_grad])


def load_flat(model: torch.nn.Module, theta_N: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            n = p.numel()
            p.copy_(theta_N[offset : offset + n].view_as(p))
            offset += n


@dataclass
class PeerConfig:
    """What one swarm peer does."""

    index: int
    initial_peers: list[str]
    num_rounds: int
    selector: str = "pulse"
    inner_steps: int = 4
    inner_lr: float = 1e-3
    run_id: str = "test"
    target_group_size: int | None = 3
    matchmaking_time: float = 10.0
    averaging_timeout: float = 6.0
    request_timeout: float = 3.0
    client_mode: bool = False
    die_in_round: int | None = None
    malicious: bool = False
    model_seed: int = 0
    start_delay: float = 0.0
    state_in: str | None = None
    state_out: str | None = None
    linger: float = 2.0
    identity_path: str | None = None
    join_late: bool = False
    """Wait for another peer's ``announce_round`` before joining (``start_delay`` then also applies)."""
    announce_round: int | None = None
    """After completing this round, let late peers join."""
    faults: dict[int, str] = field(default_factory=dict)
    """Faults to inject, by round (see :func:`_inject_faults`)."""
    attack: str | None = None
    """A Byzantine trainer: send this attack of ``experiments/byzantine/byzantine.py`` at 9x the honest norm."""
    end_together: bool = False
    """Wait for the other ``end_together`` peers after training, then ``catch_up`` (see :func:`run_peer`)."""
    record_parts: bool = False
    """Report every round's parts as sent (dense), their shard norms, and the shards' accepted lists and scales."""
    extra: dict[str, Any] = field(default_factory=dict)
    step_seconds: float = 0.0
    """Pad every inner step to this many seconds (a steady pace, as a GPU's)."""
    pause: tuple[int, float] | None = None
    """(inner step, seconds): stop training that long before that step (counted from this peer's first)."""
    exchange_delay: float = 0.0
    """Seconds each round's exchange waits before it starts (a slow link), on the round's thread only."""
    log_file: str | None = None
    """Log at INFO level to this file (else warnings to stderr, which a forked peer's test capture loses)."""


def _die_now() -> None:
    """SIGKILL this process and its children (DHT process, p2p daemon): a peer vanishing without goodbye."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def _make_malicious() -> None:
    """Corrupt this peer's contributions: round 0 non-finite values, round 1 indices out of range, then huge
    norms. The peer is otherwise honest (it serves correct sums of the shards it owns)."""
    import pulseloco.loco.validation as validation  # its encode_parts builds the parts a member pushes
    from pulseloco.codec import SparseTensor, encode_payload

    honest = validation.encode_sparse

    def evil(
        name: str, numel: int, indices_K: torch.Tensor, values_K: torch.Tensor, *, round_index: int, **kwargs: Any
    ) -> bytes:
        if name != validation.CONTRIBUTION_NAME:
            return honest(name, numel, indices_K, values_K, round_index=round_index, **kwargs)
        mode = round_index % 3
        if mode == 0:
            nan = torch.full_like(values_K, float("nan"))
            return honest(name, numel, indices_K, nan, round_index=round_index, **kwargs)
        if mode == 1:
            bigger = numel + 1000
            entry = SparseTensor(name, (bigger,), torch.float32, torch.tensor([numel + 5]), torch.ones(1))
            return encode_payload([entry], value_mode="float32", version=round_index, base_version=None)
        return honest(name, numel, indices_K, values_K * 1e4, round_index=round_index, **kwargs)

    validation.encode_sparse = evil  # type: ignore[assignment]


def _stall(seconds: float) -> None:
    """Stop this whole process (every thread: the training loop and the averager's event loop) for ``seconds``,
    as a swapping or preempted machine does; a shell child sends SIGCONT. The DHT process and the libp2p
    daemon keep running, as they would on a real machine whose Python process stalls."""
    import subprocess

    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def _inject_faults(opt: Any, faults: dict[int, str]) -> None:
    """Faults by round, each a real failure of this process or of its network behaviour:

    - ``stall:S``: the process stops for S seconds when it starts fetching the shard sums (its parts pushed);
    - ``die_fetching``: the process dies (SIGKILL, with its DHT process and daemon) when it starts fetching the
      shard sums: its parts were pushed, it fetches nothing;
    - ``cut_push`` / ``cut_pushes``: as a shard owner, end the push stream of the round's first sender without
      an answer, once (the member retries) or on every attempt (the member gives up and says so when pinged);
    - ``cut_fetch``: as a shard owner, end the sum's stream without a message for one member (the largest
      peer id other than its own) on every attempt, while serving the others;
    - ``alone``: its DHT view fails at the start of the round: it forms a group of itself alone;
    - ``stale_digest``: it registers for the round with another start digest (as after a lost repair): the others
      outvote it and it sits the round out;
    - ``miss_own``: as a shard owner, its own wait for its shard's sum ends empty (as when the aggregation outlasts
      this peer's deadline) while the sum is served to the others as usual.
    """
    from pulseloco.loco.matchmaking import Group

    averager, matchmaker = opt.averager, opt.matchmaker
    original_fetch, original_form, original_own = averager._fetch, matchmaker.form_group, averager._own_sum
    stalled: set[int] = set()

    async def fetch(owner: str, header: dict[str, Any], deadline: float) -> Any:
        fault = faults.get(header["round"], "")
        if fault == "die_fetching":
            _die_now()
        if fault.startswith("stall:") and header["round"] not in stalled:
            stalled.add(header["round"])
            _stall(float(fault.split(":")[1]))
        return await original_fetch(owner, header, deadline)

    def form_group(round_index: int, expiration: float, digest: str) -> Any:
        if faults.get(round_index) == "alone":
            me = averager.peer_id
            return Group(round=round_index, members=(me,), servers=(me,), digest=digest)
        if faults.get(round_index) == "stale_digest":
            digest = "0" * len(digest)
        return original_form(round_index, expiration, digest)

    async def own_sum(group: Any, deadline: float) -> Any:
        served = await original_own(group, deadline)
        return None if faults.get(group.round) == "miss_own" else served

    averager._fetch = fetch
    if "miss_own" in faults.values():
        averager._own_sum = own_sum
    matchmaker.form_group = form_group


def _patch_owner_faults(faults: dict[int, str]) -> None:
    """The owner-side faults of :func:`_inject_faults`, patched into this process's ``SparseAverager`` class
    before construction (hivemind registers the ``rpc_*`` handlers when the averager starts)."""
    import asyncio
    import functools
    import json

    from pulseloco.loco.averaging import SparseAverager

    original = SparseAverager.rpc_fetch
    original_push = SparseAverager.rpc_push
    cut: dict[int, str] = {}  # round -> the sender whose pushes are cut
    times_cut: dict[int, int] = {}

    @functools.wraps(original_push)
    async def rpc_push(self: Any, requests: Any, context: Any) -> Any:
        iterator = requests.__aiter__()
        first = await iterator.__anext__()
        round_index = json.loads(first.metadata or b"{}").get("round")
        fault, sender = faults.get(round_index, ""), context.remote_id.to_base58()
        first_cut = fault == "cut_push" and times_cut.get(round_index, 0) == 0
        if (first_cut or fault == "cut_pushes") and cut.setdefault(round_index, sender) == sender:
            times_cut[round_index] = times_cut.get(round_index, 0) + 1
            return  # the stream ends without an answer, the part unread

        async def chained() -> Any:
            yield first
            async for message in iterator:
                yield message

        async for message in original_push(self, chained(), context):
            yield message

    @functools.wraps(original)
    async def rpc_fetch(self: Any, request: Any, context: Any) -> Any:
        header = json.loads(request.metadata or b"{}")
        if faults.get(header.get("round")) == "cut_fetch":
            shard = self._owned_shard(header["round"], header["group"])
            if shard is not None:
                await asyncio.wait_for(shard.done.wait(), timeout=30)
                if context.remote_id.to_base58() == max((shard.expected or frozenset()) - {self.peer_id}):
                    return  # the stream ends before its first message
        async for message in original(self, request, context):
            yield message

    SparseAverager.rpc_fetch = rpc_fetch  # type: ignore[method-assign]
    SparseAverager.rpc_push = rpc_push  # type: ignore[method-assign]


def _record_parts(opt: Any, report: dict[str, Any], dense: bool) -> None:
    """Wrap the averager's ``all_reduce`` (innermost: what is actually pushed, an attack included) to report per
    round the L2 norm of this peer's part of every shard, every shard's accepted list and clip scales, and (with
    ``dense``) the parts as one dense vector; and, over the run, ``counted``: the sum of what the shards counted of
    this peer's parts (clipped at the reported scales), this peer's own view."""
    from pulseloco.loco.robust import clip_split, part_norm

    all_reduce = opt.averager.all_reduce
    counted_N = torch.zeros(opt.numel)
    report["parts"] = []
    report["counted"] = counted_N.numpy().tobytes()

    def recorded(group: Any, indices_K: torch.Tensor, values_K: torch.Tensor, *args: Any) -> Any:
        result = all_reduce(group, indices_K, values_K, *args)
        stops = torch.tensor([stop for _, stop in result.bounds], dtype=torch.int64)
        offsets = [0, *torch.searchsorted(indices_K, stops).tolist()]
        norms = [part_norm(values_K[offsets[j] : offsets[j + 1]]) for j in range(len(stops))]
        for j, scale in enumerate(result.own_scales):
            if scale is not None:
                part = slice(offsets[j], offsets[j + 1])
                counted_N.index_add_(0, indices_K[part], clip_split(values_K[part], scale)[0])
        record: dict[str, Any] = {
            "round": group.round,
            "peer_id": opt.averager.peer_id,
            "norms": norms,
            "accepted": [None if a is None else list(a) for a in result.accepted],
            "bars": list(result.bars),
        }
        if dense:
            sent_N = torch.zeros(opt.numel)
            sent_N[indices_K] = values_K
            record["sent"] = sent_N.numpy().tobytes()
        report["parts"].append(record)
        report["counted"] = counted_N.numpy().tobytes()
        return result

    opt.averager.all_reduce = recorded


def run_peer(
    config: PeerConfig, results: Any, start_barrier: Any = None, late_event: Any = None, end_barrier: Any = None
) -> None:
    """Body of a peer process: join, train ``num_rounds`` outer rounds, put a report on ``results``.

    Peers given a ``start_barrier`` begin training together, so that a slow start (process and DHT startup on a
    loaded machine) does not make a peer miss the first round's group. Peers given an ``end_barrier`` wait there
    once all have trained and then call ``PulseLoCo.catch_up``: a peer that fell a round behind and averaged its
    last round alone after the others stopped does not leave the swarm on two states.
    """
    logging.basicConfig(
        level=logging.WARNING if config.log_file is None else logging.INFO,
        filename=config.log_file,
        format=f"%(relativeCreated)d peer{config.index} %(name)s %(levelname)s %(message)s",
        force=config.log_file is not None,  # a forked peer inherits the test's handlers, which would keep it silent
    )
    procs.own_hivemind_locks()  # a fork of the test process, killed and stopped alone
    torch.set_num_threads(1)
    if config.join_late and late_event is not None:
        late_event.wait(timeout=120)
    time.sleep(config.start_delay)
    import hivemind

    from pulseloco import PulseLoCo
    from pulseloco.loco import AveragingConfig, RoundConfig

    dht = hivemind.DHT(
        initial_peers=config.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        client_mode=config.client_mode,
        start=True,
        **({} if config.identity_path is None else {"identity_path": config.identity_path}),
    )
    model = make_model(config.model_seed)
    inner_optimizer = make_inner_optimizer(model, config.inner_lr)
    if config.malicious:
        _make_malicious()
    if {"cut_fetch", "cut_push", "cut_pushes"} & set(config.faults.values()):
        _patch_owner_faults(config.faults)
    extra = dict(config.extra)
    opt = PulseLoCo(
        model,
        inner_optimizer,
        dht=dht,
        run_id=config.run_id,
        round_config=RoundConfig(
            inner_steps=config.inner_steps,
            selector=config.selector,
            topk_k=extra.pop("topk_k", 64),
            pulse_values=extra.pop("pulse_values", "float32"),
            pulse_budget=extra.pop("pulse_budget", None),
            overlap=extra.pop("overlap", False),
        ),
        averaging_config=AveragingConfig(
            target_group_size=config.target_group_size,
            matchmaking_time=config.matchmaking_time,
            averaging_timeout=config.averaging_timeout,
            request_timeout=config.request_timeout,
            exchange=extra.pop("exchange", "auto"),
            exchange_budget=extra.pop("exchange_budget", AveragingConfig.exchange_budget),
        ),
        **extra,
    )
    joined_at_round = opt.round
    if start_barrier is not None:
        start_barrier.wait(timeout=120)
    if config.state_in is not None:
        opt.load_state_dict(torch.load(config.state_in, weights_only=False))
    print(f"peer{config.index} ready t={time.time():.1f}", flush=True)
    report: dict[str, Any] = {"index": config.index, "peer_id": opt.peer_id, "joined_at_round": joined_at_round}
    report["rounds"] = []
    if config.faults:
        _inject_faults(opt, config.faults)
    if opt.averager is not None:
        _record_parts(opt, report, config.record_parts)
        if config.attack is not None:
            import byzantine

            byzantine.install(opt, config.attack, seed=config.index)
        ledger.record(opt, report)
        if config.exchange_delay:
            all_reduce = opt.averager.all_reduce

            def slow_all_reduce(*args: Any) -> Any:
                time.sleep(config.exchange_delay)
                return all_reduce(*args)

            opt.averager.all_reduce = slow_all_reduce
    if config.die_in_round is not None:
        original = opt.matchmaker.form_group

        def form_group_then_die(round_index: int, expiration: float, digest: str) -> Any:
            group = original(round_index, expiration, digest)
            if round_index == config.die_in_round:
                _die_now()
            return group

        opt.matchmaker.form_group = form_group_then_die

    def record_round(_opt: Any, m: Any) -> None:
        if m is not None:
            report["rounds"].append(
                {
                    "round": m.round,
                    "end_round": opt.round,
                    "digest": m.theta_digest,
                    "num_peers": m.num_peers,
                    "num_rejected": m.num_rejected,
                    "num_returned": m.num_returned,
                    "repaired": m.repaired,
                    "complete": m.complete,
                    "num_contributors": m.num_contributors,
                    "num_reconciled": m.num_reconciled,
                    "num_averaged": m.num_averaged,
                    "num_sent": m.num_sent,
                    "bytes_sent": m.bytes_sent,
                    "seconds_sync": m.seconds_sync,
                    "seconds_blocked": m.seconds_blocked,
                    "t": time.time(),
                }
            )

    opt.add_round_listener(record_round)
    # Blocking rounds: until the round counter (which a repair may move) reaches the target. Overlapped rounds
    # change it in the background: count the boundaries instead, then land the last round.
    target = opt.round + config.num_rounds
    steps = 0
    while (opt.num_boundaries < config.num_rounds) if opt.overlap else (opt.round < target):
        if late_event is not None and config.announce_round is not None and opt.round > config.announce_round:
            late_event.set()
        if config.pause is not None and steps == config.pause[0]:
            time.sleep(config.pause[1])
        started, steps = time.monotonic(), steps + 1
        phase = target - config.num_rounds + opt.num_boundaries if opt.overlap else opt.round
        tokens = batch(config.index, phase * config.inner_steps + opt.local_step)
        loss = inner_step(model, inner_optimizer, tokens)
        time.sleep(max(0.0, config.step_seconds - (time.monotonic() - started)))
        opt.step(loss=loss)
        opt.zero_grad()
    if config.state_out is not None:  # at the boundary (an overlapped round in flight is waited for, not landed)
        torch.save(opt.state_dict(), config.state_out)
    opt.finish()
    if end_barrier is not None:
        end_barrier.wait(timeout=120)
        opt.catch_up()
    # Plain bytes: a tensor would travel as shared memory that must outlive this process.
    report["theta"] = opt.theta_N.numpy().tobytes()
    report["residual"] = opt.residual_N.numpy().tobytes()
    report["final_round"] = opt.round
    report["distrusted"] = list(opt.averager.distrusted_peers()) if opt.averager is not None else []
    results.put(report)
    # Stay reachable a little so that slower peers can finish fetching shards and state from this one.
    time.sleep(config.linger)
    opt.shutdown()
    dht.shutdown()
    print(f"peer{config.index} done t={time.time():.1f}", flush=True)
