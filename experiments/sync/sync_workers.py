"""The peers of ``experiments/sync/bench_sync.py``: a trainer that publishes with PULSESync and rollout workers that
follow it, one process each, driven by the coordinator (:mod:`sync_coordinator`) over :mod:`harness.channel`.

A worker is the script itself run as ``bench_sync.py --role publisher|subscriber --spec PATH`` (the coordinator
starts it, in its peer's network namespace when there is one); the script hands both flags to :func:`worker_main`.
The spec is a :class:`WorkerSpec` written as JSON. The messages:

* publisher: sends ``("ready", info)`` once its model and DHT are up; then answers ``("publish", step)`` with
  ``("published", measurements)`` and ``("stats",)`` with ``("stats", counters)``, until ``("stop",)``;
* subscriber: says ``("hello", ...)`` on connecting (:func:`harness.channel.connect`), waits for ``("join", maddrs)``,
  answers ``("joined", {"peer_id": ...})``, and after ``("follow",)`` sends ``("holds", report)`` for every version
  it holds, until ``("stop",)``.

A worker whose coordinator goes away (``EOFError`` on its connection) logs a warning and stops; any other error
propagates, so the process exits non-zero and the coordinator reports its log. Both close their DHT on the way out.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import channel
from harness.models import SyntheticLM

LR = 3e-6
"""AdamW learning rate of the trainer (``--lr``'s default)."""
BATCH_SIZE = 2
SEQ_LEN = 64
"""The trainer's synthetic batches: ``BATCH_SIZE`` sequences of ``SEQ_LEN`` seeded random token ids."""


@dataclass
class WorkerSpec:
    """Everything a worker process needs, written as JSON by the coordinator."""

    role: str  # "publisher" or "subscriber"
    index: int  # 0 for the publisher, 1..N for subscribers
    socket: str  # the coordinator's AF_UNIX socket (works across network namespaces)
    run_id: str
    config: str
    host: str  # the address the peer's libp2p daemon listens on
    full: bool  # full-checkpoint baseline
    key_path: str  # private key (publisher) or public key (subscribers)
    shapes_path: str = ""  # subscribers: JSON of state_shapes (so they need not import transformers)
    store_dir: str = ""
    seed: int = 0
    lr: float = LR
    poll: float = 0.2
    fetch_timeout: float = 600.0
    relay_wait: float | None = None  # None: the library's SwarmSource default
    relay_max_bytes: int | None = None  # None: the library's Subscriber default
    threads: int | None = None


def _worker_logging() -> None:
    """INFO lines with the process id to the worker's log file (its stderr); hivemind and the store quieter."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    logging.getLogger("pulseloco.sync.store").setLevel(logging.WARNING)


def _file_size(path: Path) -> int | None:
    """Size of ``path`` in bytes; None when it does not exist (other OSErrors propagate)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def publisher_worker(spec: WorkerSpec) -> None:
    """The trainer: build the model, then answer the coordinator's publish/stats/stop requests.

    Raises RuntimeError when a version was not published (the publisher's last error in the message)."""
    _worker_logging()
    conn, send = channel.connect(spec.socket, spec.role, spec.index)
    import torch

    from pulseloco.swarm import SwarmConfig, make_dht
    from pulseloco.sync.publisher import Publisher
    from pulseloco.sync.signing import load_private_key

    if spec.threads:
        torch.set_num_threads(spec.threads)
    training = SyntheticLM(spec.config, spec.seed, spec.lr, batch_size=BATCH_SIZE, seq_len=SEQ_LEN)
    model = training.model
    num_elements = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
    dht = make_dht(SwarmConfig(host_maddrs=[f"/ip4/{spec.host}/tcp/0"]))
    publisher = Publisher(
        dht, spec.run_id, load_private_key(spec.key_path), spec.store_dir, anchor_every=1 if spec.full else 10
    )
    store = Path(spec.store_dir)
    send(
        (
            "ready",
            {
                "maddrs": [str(m) for m in dht.get_visible_maddrs()],
                "num_params": sum(p.numel() for p in model.parameters()),
                "num_elements": num_elements,
                "threads": torch.get_num_threads(),
                "peer_id": publisher.endpoint.peer_id.to_base58() if publisher.endpoint else "",
            },
        )
    )
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "stats":
                servicer = publisher.endpoint.servicer if publisher.endpoint else None
                send(("stats", {"bytes_uploaded": publisher.bytes_uploaded, "uploads": servicer.num_uploads}))
            elif msg[0] == "publish":
                step_s = loss = None
                if msg[1]:  # one optimizer step first (its gradients freed while the version is published)
                    loss, step_s = training.step()
                t_call = time.time()
                version = publisher.publish(model)
                t_returned = time.time()
                publisher.flush(timeout=900)
                t_ready = time.time()
                if publisher.version != version:
                    raise RuntimeError(f"version {version} was not published: {publisher.last_error!r}")
                send(
                    (
                        "published",
                        {
                            "version": version,
                            "digest": publisher.digest,
                            "t_call": t_call,
                            "publish_call_s": t_returned - t_call,
                            "encode_s": t_ready - t_call,
                            "patch_bytes": _file_size(store / f"v{version:08d}.patch"),
                            "anchor_bytes": _file_size(store / f"v{version:08d}.anchor"),
                            "step_s": step_s,
                            "loss": loss,
                        },
                    )
                )
    except EOFError:
        logging.getLogger(__name__).warning("coordinator went away; stopping")
    finally:
        publisher.close(timeout=10)
        dht.shutdown()


def subscriber_worker(spec: WorkerSpec) -> None:
    """A rollout worker: join the publisher's swarm, follow the run, report every version it holds.

    Returns without joining when the coordinator's first message is not ``join``."""
    _worker_logging()
    conn, send = channel.connect(spec.socket, spec.role, spec.index)
    import torch

    from pulseloco.swarm import SwarmConfig, make_dht
    from pulseloco.sync import state_digest
    from pulseloco.sync.signing import load_public_key
    from pulseloco.sync.subscriber import Subscriber

    torch.set_num_threads(spec.threads or 1)
    # Workaround: Subscriber.update on an empty dict adopts the anchor into a copy of the dict, so the caller's
    # dict stays empty and every later update downloads the anchor again. Like a rollout worker holding a
    # model, the subscriber gets zeroed BF16 tensors of the right names and shapes, which the anchor overwrites.
    shapes = json.loads(Path(spec.shapes_path).read_text())
    state = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
    msg = conn.recv()
    if msg[0] != "join":
        return
    dht = make_dht(SwarmConfig(initial_peers=msg[1], host_maddrs=[f"/ip4/{spec.host}/tcp/0"]))
    options = {} if spec.relay_max_bytes is None else {"relay_max_bytes": spec.relay_max_bytes}
    sub = Subscriber(
        dht,
        spec.run_id,
        load_public_key(spec.key_path),
        full_checkpoints=spec.full,
        timeout=spec.fetch_timeout,
        **options,
    )
    if spec.relay_wait is not None:
        sub.source.relay_wait = spec.relay_wait
    swarm_source = sub.source
    if spec.full:
        # Workaround: the relay keeps its last 16 objects in memory whatever their size; in this mode they are
        # full checkpoints (16 x 2 bytes per parameter). Only the newest is ever requested here.
        sub.relay.capacity = 1

    def on_update(report: Any) -> None:
        t_hold = report.held_at or time.time()  # when the model held it
        with sub.lock:
            digest = state_digest(state)  # the tensors this worker holds, not the subscriber's bookkeeping
        # who served the object of this version (the last fetch of it: the patch, squash or anchor)
        served = [peer for _, version, peer in list(swarm_source.served_by) if version == report.version]
        send(
            (
                "holds",
                {
                    "version": report.version,
                    "t": t_hold,
                    "digest": digest,
                    "reported_digest": report.digest,
                    "bytes_received": report.bytes_received,
                    "path": report.path,
                    "update_s": report.seconds,
                    "served_by": served[-1] if served else None,
                },
            )
        )

    send(("joined", {"peer_id": sub.endpoint.peer_id.to_base58() if sub.endpoint else ""}))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "follow":
                sub.follow(state, on_update, interval=spec.poll)
    except EOFError:
        logging.getLogger(__name__).warning("coordinator went away; stopping")
    finally:
        sub.close()
        dht.shutdown()


def worker_main(role: str, spec_path: str) -> int:
    """Run the worker of ``role`` (``publisher`` or ``subscriber``) from the JSON spec at ``spec_path`` until the
    coordinator stops it; returns 0. Raises OSError/ValueError for an unreadable spec, and whatever the worker
    raises (the process then exits non-zero)."""
    spec = WorkerSpec(**json.loads(Path(spec_path).read_text()))
    if role == "publisher":
        publisher_worker(spec)
    else:
        subscriber_worker(spec)
    return 0
