"""A swarm peer for the NAT tests, run inside a network namespace: ``python tests/nat_peer.py ROLE CONFIG_JSON``.

It joins the swarm with :func:`pulseloco.swarm.make_dht` (the configuration under test), prints one JSON object
per line on stdout (``{"event": ...}``) and takes JSON commands on stdin, one per line; EOF on stdin ends it
(it shuts its DHT down, so no daemon outlives it). Roles:

- ``dht``: a bootstrap node (and relay); prints ``ready`` and waits for EOF.
- ``loco``: a PulseLoCo trainer on a tiny deterministic model. Prints ``ready`` (peer id, addresses,
  reachability, whether it owns shards), waits for ``{"cmd": "go"}``, trains ``rounds`` outer rounds printing
  ``round`` lines (peers, digest, bytes, seconds since ``go``), prints
  ``done`` with its final round and theta digest, then keeps serving until EOF.
- ``publisher``: a PULSESync publisher of a small state dict; ``{"cmd": "publish"}`` takes a deterministic
  step, publishes, waits for it, and answers ``published`` (version, digest, patch size); ``{"cmd": "stats"}``
  answers ``stats`` (bytes uploaded so far).
- ``subscriber``: ``{"cmd": "update"}`` brings its state to the head and answers ``updated`` (version,
  digests, path, whether it announced itself as a relay); ``{"cmd": "providers"}`` answers the provider record.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

import torch

from pulseloco.swarm import SwarmConfig, is_reachable, latest_maddrs, make_dht


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def commands() -> Any:
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def tiny_state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(64, 32, generator=gen), "w2": torch.randn(32, generator=gen)}


def run_loco(dht: Any, config: dict[str, Any]) -> None:
    from pulseloco import PulseLoCo
    from pulseloco.loco import AveragingConfig, RoundConfig
    from pulseloco.loco.validation import theta_digest

    torch.manual_seed(0)  # every peer starts from the same model
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = PulseLoCo(
        model,
        inner,
        dht=dht,
        run_id=config.get("run_id", "nat"),
        round_config=RoundConfig(inner_steps=2, selector="dense"),
        averaging_config=AveragingConfig(
            target_group_size=config.get("target_group_size", 2),
            matchmaking_time=config.get("matchmaking_time", 5.0),
            averaging_timeout=config.get("averaging_timeout", 10.0),
            request_timeout=config.get("request_timeout", 5.0),
        ),
        client_mode=config.get("loco_client_mode"),
    )
    maddrs = latest_maddrs(dht)
    emit("ready", peer_id=opt.peer_id, maddrs=maddrs, reachable=is_reachable(dht), serves=not opt.averager.client_mode)
    cmds = commands()
    next(cmds)  # go
    started = time.monotonic()
    gen = torch.Generator().manual_seed(1000 + config.get("index", 0))
    target = opt.round + config["rounds"]
    while opt.round < target:
        x = torch.randn(8, 16, generator=gen)
        loss = ((model(x) - x[:, :1]) ** 2).mean()
        loss.backward()
        before = opt.round
        opt.step(loss=loss)
        opt.zero_grad()
        m = opt.last_metrics
        if opt.round != before and m is not None:
            emit(
                "round",
                round=m.round,
                num_peers=m.num_peers,
                digest=m.theta_digest,
                repaired=m.repaired,
                bytes_sent=m.bytes_sent,
                bytes_received=m.bytes_received,
                seconds=round(time.monotonic() - started, 2),
            )
    emit("done", round=opt.round, digest=theta_digest(opt.theta_N))
    for _ in cmds:  # keep serving shards and state until the test is done with us
        pass
    opt.shutdown()


def run_publisher(dht: Any, config: dict[str, Any]) -> None:
    from pulseloco.sync.publisher import Publisher
    from pulseloco.sync.signing import load_private_key

    key = load_private_key(config["key"])
    pub = Publisher(dht, config["run_id"], key, config["store"], max_uploads_per_version=1, anchor_every=100)
    emit("ready", peer_id=str(dht.peer_id), maddrs=[str(m) for m in dht.get_visible_maddrs()])
    state = tiny_state(0)
    gen = torch.Generator().manual_seed(7)
    try:
        for cmd in commands():
            if cmd["cmd"] == "stats":
                emit("stats", uploaded=pub.bytes_uploaded)
                continue
            if pub.version is not None:  # a sparse update: a few elements move, as in RL fine-tuning
                for t in state.values():
                    flat = t.view(-1)
                    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=gen)
                    flat[idx] += 0.5
            version = pub.publish(state)
            pub.flush(timeout=30)
            size = len(pub.store.read("patch", version)[1]) if pub.store.has("patch", version) else 0
            emit("published", version=version, digest=pub.digest, patch_bytes=size)
    finally:
        pub.close()


def run_subscriber(dht: Any, config: dict[str, Any]) -> None:
    from pulseloco.sync.signing import load_public_key
    from pulseloco.sync.subscriber import Subscriber

    sub = Subscriber(dht, config["run_id"], load_public_key(config["public_key"]), timeout=30)
    assert sub.endpoint is not None
    state: dict[str, torch.Tensor] = {}
    me = sub.endpoint.peer_id.to_base58()
    emit("ready", peer_id=me, maddrs=[str(m) for m in dht.get_visible_maddrs()], reachable=is_reachable(dht))
    try:
        for cmd in commands():
            if cmd["cmd"] == "update":
                report = sub.update_report(state)
                announced = sub.announced
                if announced and sub.version is not None:  # a relay is only useful once the DHT shows it
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline:
                        if sub.version in sub.endpoint.get_providers().get(me, {}).get("versions", []):
                            break
                        time.sleep(0.1)
                emit(
                    "updated",
                    version=sub.version,
                    digest=sub.digest,
                    path=report.path if report else None,
                    announced=announced,
                    relayed=sub.endpoint.servicer.bytes_uploaded if sub.endpoint.servicer else 0,
                )
            elif cmd["cmd"] == "providers":
                emit("providers", providers=sub.endpoint.get_providers())
    finally:
        sub.close()


def main() -> None:
    role, config = sys.argv[1], json.loads(sys.argv[2])
    logging.basicConfig(level=logging.WARNING, format=f"{role}-{config.get('index', 0)} %(name)s: %(message)s")
    torch.set_num_threads(1)
    dht = make_dht(SwarmConfig(**config["swarm"]))
    try:
        if role == "dht":
            emit("ready", peer_id=str(dht.peer_id), maddrs=[str(m) for m in dht.get_visible_maddrs()])
            for _ in commands():
                pass
        elif role == "loco":
            run_loco(dht, config)
        elif role == "publisher":
            run_publisher(dht, config)
        elif role == "subscriber":
            run_subscriber(dht, config)
        else:
            raise SystemExit(f"unknown role {role!r}")
    finally:
        dht.shutdown()
    threading.Event().wait(0.1)


if __name__ == "__main__":
    main()
