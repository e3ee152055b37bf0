"""``accelerate launch``-style multi-process peers: only rank 0 joins the swarm, the others get theta by broadcast.

Two processes in a gloo ``torch.distributed`` group (what accelerate initializes), rank 0 with a real DHT on
127.0.0.1, rank 1 without one. Each rank trains on its own data and starts from its own random init: after every
round both must hold rank 0's theta, bit for bit, in their models.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import procs
from loco_helpers import batch, flat_params, inner_step, make_inner_optimizer, make_model

NUM_ROUNDS = 2
H = 2


def _rank_main(rank: int, init_file: str, results: Any, overlap: bool) -> None:
    import torch.distributed as dist

    procs.own_hivemind_locks()  # a fork of the test process, which imported hivemind
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    dht = None
    if rank == 0:
        import hivemind

        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    from pulseloco import PulseLoCo
    from pulseloco.loco import AveragingConfig, RoundConfig

    model = make_model(seed=rank)
    inner = make_inner_optimizer(model, 1e-3)
    opt = PulseLoCo(
        model,
        inner,
        dht=dht,
        run_id="dist",
        round_config=RoundConfig(inner_steps=H, overlap=overlap),
        averaging_config=AveragingConfig(target_group_size=1, matchmaking_time=2.0),
    )
    report: dict[str, Any] = {"rank": rank, "joined": opt.peer_id is not None, "thetas": [], "models": []}
    report["thetas"].append(opt.theta_N.numpy().tobytes())
    report["models"].append(flat_params(model).numpy().tobytes())
    for step in range(NUM_ROUNDS * H):
        inner_step(model, inner, batch(rank, step))
        opt.step()
        opt.zero_grad()
        if opt.local_step == 0:
            report["thetas"].append(opt.theta_N.numpy().tobytes())
            report["models"].append(flat_params(model).numpy().tobytes())
    if overlap:  # the last round lands on every rank, and the model then holds theta
        opt.finish()
        report["thetas"].append(opt.theta_N.numpy().tobytes())
        report["models"].append(flat_params(model).numpy().tobytes())
    report["has_metrics"] = opt.last_metrics is not None
    results.put(report)
    opt.shutdown()
    if dht is not None:
        dht.shutdown()
    dist.destroy_process_group()


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_only_the_main_process_joins_and_others_receive_theta_by_broadcast(tmp_path: Path, overlap: bool) -> None:
    """With ``overlap`` the rounds land one boundary late; every rank still receives each landed theta, and after
    ``finish`` every model holds the last one (between boundaries a rank's model is theta minus its own phase's
    pseudo-gradient: equal on every rank under DDP, whose ranks share their gradients; not here)."""
    make_model(0)  # import the model code before forking
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    init = str(tmp_path / "init")
    procs = [ctx.Process(target=_rank_main, args=(rank, init, results, overlap)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        reports = sorted([results.get(timeout=90) for _ in procs], key=lambda r: r["rank"])
    except queue.Empty:
        pytest.fail(f"ranks did not report; exit codes {[p.exitcode for p in procs]}")
    finally:
        for proc in procs:
            proc.join(timeout=15)
    main, other = reports
    assert main["joined"] and not other["joined"]
    assert main["has_metrics"] and not other["has_metrics"]
    assert len(main["thetas"]) == NUM_ROUNDS + 1 + overlap
    assert main["thetas"] == other["thetas"]  # construction and every round
    if overlap:
        assert main["thetas"][1] == main["thetas"][0]  # the first boundary lands nothing
        assert main["thetas"][-1] != main["thetas"][0]
        assert main["models"][-1] == main["thetas"][-1] and other["models"][-1] == other["thetas"][-1]
    else:
        assert main["models"] == main["thetas"] and other["models"] == other["thetas"]
    assert torch.frombuffer(bytearray(main["thetas"][0]), dtype=torch.float32).numel() > 0
