"""PULSESync over a real swarm: hivemind DHTs and libp2p daemons on 127.0.0.1, subscribers in their own processes.

The trainer is a tiny transformers model taking AdamW steps; every digest a subscriber reaches is compared with
the digest of the trainer's weights cast to BF16 at that version, computed independently of the publisher.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
import typing
from collections import Counter
from pathlib import Path

import hivemind
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time
from sync_helpers import (
    Trainer,
    WorkerProcess,
    bf16_digest,
    close_all,
    maddrs,
    rogue_provider_worker,
    start_dht,
    subscriber_worker,
    tiny_model,
    wait_until_provider_lists,
)

from pulseloco.errors import PatchError
from pulseloco.sync.publisher import Publisher
from pulseloco.sync.signing import Envelope, generate_key, sign_envelope
from pulseloco.sync.sources import PUBLISHER_ATTEMPTS
from pulseloco.sync.subscriber import Subscriber
from pulseloco.sync.transport import SyncServicer

RUN = "swarm-test"


@pytest.fixture(scope="module")
def bootstrap():
    """The swarm's first peer: every other DHT in this module joins through it."""
    dht = start_dht()
    yield dht
    dht.shutdown()


@pytest.fixture
def key():
    return generate_key()


@pytest.fixture
def start_publisher(bootstrap, key, tmp_path: Path) -> typing.Iterator[typing.Callable[..., Publisher]]:
    """``start_publisher(run, **options)``: a Publisher of ``run`` on a DHT peer of its own, storing under
    ``tmp_path / "store"``; each one and its DHT are closed after the test (after the test's own cleanup)."""
    started: list[tuple[Publisher, hivemind.DHT]] = []

    def start(run: str, **options: typing.Any) -> Publisher:
        dht = start_dht(maddrs(bootstrap))
        started.append((Publisher(dht, run, key, tmp_path / "store", **options), dht))
        return started[-1][0]

    yield start
    for publisher, dht in reversed(started):
        publisher.close()
        dht.shutdown()


def public_pem(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


class InProcessPeer:
    """A subscriber in the test process with a DHT peer of its own (each relay needs its own peer id)."""

    def __init__(self, peers: list[str], run_id: str, key, **options) -> None:
        self.dht = start_dht(peers)
        self.sub = Subscriber(self.dht, run_id, key.public_key(), **options)
        self.model = tiny_model(seed=99, dtype=torch.bfloat16)

    def close(self) -> None:
        self.sub.close()
        self.dht.shutdown()


def patch_size(publisher: Publisher, version: int) -> int:
    return len(publisher.store.read("patch", version)[1])


# ---- a training model's versions, followed by three subscribers --------------------------------------------


@pytest.mark.timeout(180)
def test_three_subscribers_follow_twenty_versions_of_a_training_model(bootstrap, key, tmp_path: Path) -> None:
    """Publisher + three subscriber processes over 20 AdamW versions.

    A follows every version (BF16 model, patched in place); B (FP32 model, through the BF16 shadow) misses
    versions 6-9 and catches up by one squashed patch; C joins at version 13 with an empty state dict and
    restores the newest anchor plus patches. The publisher is restarted (new process-level DHT peer, same store) before
    version 18 and continues the chain. With ``max_uploads_per_version=1`` the second and third subscriber get
    each patch from a relay, so the publisher uploads at most two patches per version.
    """
    peers = maddrs(bootstrap)
    pem = public_pem(key)
    a = WorkerProcess(subscriber_worker, peers, RUN, pem, {"timeout": 30}, name="sub-A")
    b = WorkerProcess(subscriber_worker, peers, RUN, pem, {"timeout": 30, "model": "float32"}, name="sub-B")
    c = WorkerProcess(subscriber_worker, peers, RUN, pem, {"timeout": 30, "model": "dict"}, name="sub-C")
    workers = {"A": a, "B": b, "C": c}
    store = tmp_path / "store"
    options = dict(anchor_every=5, keep_anchors=2, max_uploads_per_version=1)
    pub_dht = None
    pub = None
    try:
        a.send("start")
        b.send("start")
        trainer = Trainer()
        pub_dht = start_dht(peers)
        pub = Publisher(pub_dht, RUN, key, store, **options)
        peer_ids = {"A": a.receive(), "B": b.receive()}
        expected: dict[int, str] = {}
        results: dict[str, dict[int, dict]] = {name: {} for name in workers}
        publisher_patch_uploads: dict[int, tuple[int, int]] = {}
        for v in range(1, 21):
            if v > 1:
                trainer.step()
            if v == 12:
                c.send("start")  # C joins the swarm while versions go on
            if v == 13:
                peer_ids["C"] = c.receive()
            if v == 18:
                pub.close()
                pub_dht.shutdown()
                pub_dht = start_dht(peers)
                pub = Publisher(pub_dht, RUN, key, store, **options)
                assert (pub.version, pub.digest) == (17, expected[17]), "restart must resume the chain"
            uploaded_before = pub.bytes_uploaded
            assert pub.publish(trainer.model) == v
            assert pub.flush(timeout=30) == v
            expected[v] = trainer.digest()
            assert pub.digest == expected[v]
            active = ["A"] + (["B"] if not 6 <= v <= 9 else []) + (["C"] if v >= 13 else [])
            for name in active:
                result = workers[name].call("update")
                results[name][v] = result
                assert result["version"] == v, (name, result)
                assert result["digest"] == expected[v], f"{name} at version {v}: subscriber digest differs"
                assert result["model_digest"] == expected[v], f"{name} at version {v}: model weights differ"
            if v > 1:
                publisher_patch_uploads[v] = (pub.bytes_uploaded - uploaded_before, patch_size(pub, v))

        paths = {name: {v: r["path"] for v, r in res.items()} for name, res in results.items()}
        assert paths["A"] == {v: "anchor" if v == 1 else "patch" for v in range(1, 21)}
        assert paths["B"][1] == "anchor" and paths["B"][10] == "squash"
        assert all(paths["B"][v] == "patch" for v in range(11, 21)) and all(paths["B"][v] == "patch" for v in (2, 5))
        assert paths["C"][13] == "anchor" and all(paths["C"][v] == "patch" for v in range(14, 21))
        # squash and late anchor moved fewer bytes than replaying everything from scratch would
        assert results["B"][10]["bytes"] < sum(patch_size(pub, v) for v in range(18, 21)) * 10

        # Relay: in versions where every active subscriber took the patch, the publisher served it at most twice.
        for v, (uploaded, size) in publisher_patch_uploads.items():
            if v in (10, 13):  # B's squash, C's anchor come from the publisher on top of the patch
                continue
            assert uploaded <= 2 * size, f"version {v}: publisher uploaded {uploaded} bytes for a {size}-byte patch"
        relayed = sum(results[name][20]["relay_bytes_uploaded"] for name in workers)
        assert relayed > 0, "no subscriber served another one"
    finally:
        close_all(list(workers.values()))
        if pub is not None:
            pub.close()
        if pub_dht is not None:
            pub_dht.shutdown()


# ---- hostile and broken peers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rogues():
    """Rogue provider processes, spawned at once for the module (their imports take seconds); a test starts the
    ones it uses and closes them (their DHT peers are the test's processes)."""
    modes = ("corrupt", "forged", "stall")
    procs = {mode: WorkerProcess(rogue_provider_worker, mode, name=f"rogue-{mode}") for mode in modes}
    yield procs
    close_all(list(procs.values()))


def publish_versions(pub: Publisher, trainer: Trainer, count: int, expected: dict[int, str]) -> None:
    for _ in range(count):
        if pub.version is not None:
            trainer.step()
        v = pub.publish(trainer.model)
        assert pub.flush(timeout=30) == v
        expected[v] = trainer.digest()
        assert pub.digest == expected[v]


def fetch_failures(caplog: pytest.LogCaptureFixture, peer_id: str, error: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "pulseloco.sync.sources"
        and "fetch failed" in r.getMessage()
        and peer_id in r.getMessage()
        and error in r.getMessage()
    ]


@pytest.mark.timeout(120)
def test_corrupted_and_forged_objects_from_relays_are_rejected_and_recovered(
    start_publisher, bootstrap, rogues, key, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two strangers announce themselves as relays (tried before the publisher): one serves the genuine
    envelope with one flipped bit in the payload, the other a well-formed object with other weights signed by
    another key. The subscriber rejects both (UnauthorizedError) and reaches the publisher's digests."""
    peers = maddrs(bootstrap)
    store = tmp_path / "store"
    pub = start_publisher(RUN + "-rogue", anchor_every=10)
    peer = None
    try:
        rogues["corrupt"].send("start", peers, RUN + "-rogue", str(store))
        rogues["forged"].send("start", peers, RUN + "-rogue", str(store))
        trainer, expected = Trainer(), {}
        publish_versions(pub, trainer, 3, expected)
        corrupt_id, forged_id = rogues["corrupt"].receive(), rogues["forged"].receive()
        peer = InProcessPeer(peers, RUN + "-rogue", key, timeout=30)
        for rogue_id in (corrupt_id, forged_id):
            wait_until_provider_lists(peer.sub.endpoint, rogue_id, 3)
        before = bf16_digest(peer.model)

        with caplog.at_level(logging.WARNING, logger="pulseloco"):
            assert peer.sub.update(peer.model) == 3  # anchor 1 + patches 2, 3: each offered by both rogues first
            assert bf16_digest(peer.model) == peer.sub.digest == expected[3] != before
            publish_versions(pub, trainer, 1, expected)
            wait_until_provider_lists(peer.sub.endpoint, corrupt_id, 4)
            wait_until_provider_lists(peer.sub.endpoint, forged_id, 4)
            report = peer.sub.update_report(peer.model)
        assert report is not None and (report.version, report.path) == (4, "patch")
        assert bf16_digest(peer.model) == expected[4]
        assert fetch_failures(caplog, corrupt_id, "UnauthorizedError"), "the corrupted payload was not rejected"
        assert fetch_failures(caplog, forged_id, "UnauthorizedError"), "the forged object was not rejected"
        assert any("signed SHA-256" in m for m in fetch_failures(caplog, corrupt_id, "UnauthorizedError"))
        assert any("not signed by the trusted" in m for m in fetch_failures(caplog, forged_id, "UnauthorizedError"))
        # every object of versions 1-3 was first offered by each rogue: anchor 1 and patches 2, 3; patch 4, which no
        # relay listed at the subscriber's last lookup, was asked of the publisher first, with no lookup
        assert rogues["corrupt"].call("served") >= 3 and rogues["forged"].call("served") >= 3
        assert peer.sub.source.served_by[-1] == ("patch", 4, pub.endpoint.peer_id.to_base58())  # type: ignore[attr-defined]
    finally:
        close_all([rogues["corrupt"], rogues["forged"]])
        if peer is not None:
            peer.close()


@pytest.mark.timeout(90)
def test_a_provider_that_stalls_times_out_and_the_next_one_serves(
    start_publisher, bootstrap, rogues, key, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    peers = maddrs(bootstrap)
    run = RUN + "-stall"
    store = tmp_path / "store"
    pub = start_publisher(run)
    peer = None
    try:
        trainer, expected = Trainer(), {}
        publish_versions(pub, trainer, 1, expected)
        peer = InProcessPeer(peers, run, key, timeout=30)
        assert peer.sub.update(peer.model) == 1
        stall_id = rogues["stall"].call("start", peers, run, str(store))
        peer.sub.source.chunk_timeout = 2.0  # seconds a provider may stay silent (10 by default)
        peer.sub.source.publishers = []  # no publisher known: a new version is looked up too, relays first
        publish_versions(pub, trainer, 1, expected)
        wait_until_provider_lists(peer.sub.endpoint, stall_id, 2)
        with caplog.at_level(logging.WARNING, logger="pulseloco"):
            report = peer.sub.update_report(peer.model)
        assert report is not None and (report.version, report.path) == (2, "patch")
        assert bf16_digest(peer.model) == expected[2]
        assert fetch_failures(caplog, stall_id, "TimeoutError"), "the stalled provider was not timed out"
        assert rogues["stall"].call("served") >= 1
    finally:
        rogues["stall"].close()
        if peer is not None:
            peer.close()


@pytest.mark.timeout(90)
def test_a_publisher_stream_that_ends_early_is_asked_again(
    start_publisher, bootstrap, key, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publisher's first answer ends after its header (as a libp2p stream can under load): the subscriber
    asks it again instead of failing the update, and stops asking after PUBLISHER_ATTEMPTS broken answers."""
    original = SyncServicer.rpc_fetch
    broken_left = [1]

    async def ends_early(
        self: SyncServicer, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:
        async with contextlib.aclosing(original(self, request, context)) as messages:
            async for message in messages:
                yield message
                if broken_left[0] > 0:  # the header went out; end the stream there
                    broken_left[0] -= 1
                    return

    monkeypatch.setattr(SyncServicer, "rpc_fetch", ends_early)
    peers = maddrs(bootstrap)
    run = RUN + "-early"
    # broken answers count as uploads: a budget above them, so that no answer is "busy" (that waits for relays)
    pub = start_publisher(run, max_uploads_per_version=100)
    peer = None
    try:
        trainer, expected = Trainer(), {}
        publish_versions(pub, trainer, 1, expected)
        peer = InProcessPeer(peers, run, key, timeout=30)
        assert pub.endpoint is not None
        publisher_id = pub.endpoint.peer_id.to_base58()
        with caplog.at_level(logging.WARNING, logger="pulseloco"):
            assert peer.sub.update(peer.model) == 1
        assert bf16_digest(peer.model) == expected[1]
        assert len(fetch_failures(caplog, publisher_id, "TruncatedPayloadError")) == 1, caplog.text

        broken_left[0] = 1000  # every answer breaks: the update fails, the model keeps version 1
        publish_versions(pub, trainer, 1, expected)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pulseloco"), pytest.raises(PatchError):
            peer.sub.update(peer.model)
        assert bf16_digest(peer.model) == expected[1]
        failures = fetch_failures(caplog, publisher_id, "TruncatedPayloadError")
        per_request = Counter(message.split("request=")[1].split(" error=")[0] for message in failures)
        assert per_request and set(per_request.values()) == {PUBLISHER_ATTEMPTS}, per_request  # each asked 3 times
    finally:
        if peer is not None:
            peer.close()


@pytest.mark.timeout(90)
def test_forged_head_record_unknown_run_and_oversized_payloads_are_refused(
    start_publisher, bootstrap, key, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stranger overwrites the run's head record in the DHT with a newer version signed by another key: it is
    ignored (nothing applied) and the genuine head wins again at the publisher's next announcement. A run
    nobody publishes has no head. A payload over ``max_payload_bytes`` is refused before it is downloaded."""
    peers = maddrs(bootstrap)
    run = RUN + "-head"
    # records announced every 200 s: no re-announcement overwrites the stranger's record before the test reads it
    pub = start_publisher(run, head_ttl=600, provider_ttl=600)
    peer = None
    try:
        trainer, expected = Trainer(), {}
        publish_versions(pub, trainer, 2, expected)
        peer = InProcessPeer(peers, run, key, timeout=20)

        # oversized: the anchor is ~100 kB, the limit 4 kB; nothing is applied, then a larger limit works
        before = bf16_digest(peer.model)
        peer.sub.source.max_payload_bytes = 4096
        with caplog.at_level(logging.WARNING, logger="pulseloco"), pytest.raises(PatchError):
            peer.sub.update(peer.model)
        assert peer.sub.version is None and bf16_digest(peer.model) == before
        assert any("PayloadSizeError" in r.getMessage() for r in caplog.records)
        peer.sub.source.max_payload_bytes = 1 << 20
        assert peer.sub.update(peer.model) == 2 and bf16_digest(peer.model) == expected[2]

        # forged head: newer version, another key, stored to outlive the publisher's record
        stranger = generate_key()
        forged = Envelope(run, "head", 99, None, "0" * 32, "", "", 0, anchor_version=99, time=time.time())
        assert peer.dht.store(
            f"pulseloco:{run}:head", sign_envelope(stranger, forged), expiration_time=get_dht_time() + 601
        ), "the DHT did not take the stranger's record"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pulseloco"):
            assert peer.sub.update_report(peer.model) is None
        assert peer.sub.version == 2 and bf16_digest(peer.model) == expected[2]
        assert any("fails verification" in r.getMessage() for r in caplog.records)
        time.sleep(1.5)  # the publisher's next record expires later than the stranger's
        publish_versions(pub, trainer, 1, expected)
        assert peer.sub.update(peer.model) == 3 and bf16_digest(peer.model) == expected[3]

        # a provider record lists every version a provider holds (publishers keep up to anchors x anchor_every)
        held = [*range(1, 301), 1, 100, 200]
        peer.sub.endpoint.announce_provider(held, publisher=False, ttl=120, timeout=10)
        listed = peer.sub.endpoint.get_providers()[peer.sub.endpoint.peer_id.to_base58()]["versions"]
        assert listed == list(range(1, 301))

        # a run nobody publishes: no head, nothing changes
        ghost = Subscriber(peer.dht, "no-such-run", key.public_key(), relay=False, timeout=5)
        try:
            model = tiny_model(seed=5, dtype=torch.bfloat16)
            before = bf16_digest(model)
            assert ghost.update(model) is None and bf16_digest(model) == before
        finally:
            ghost.close()
    finally:
        if peer is not None:
            peer.close()


@pytest.mark.timeout(90)
def test_follow_keeps_a_model_current_in_the_background(start_publisher, bootstrap, key, tmp_path: Path) -> None:
    peers = maddrs(bootstrap)
    run = RUN + "-follow"
    pub = start_publisher(run, anchor_every=3)
    peer = None
    try:
        trainer, expected = Trainer(), {}
        peer = InProcessPeer(peers, run, key, timeout=20)
        reports = []
        seen = {}

        def on_update(report) -> None:
            with peer.sub.lock:  # what a generation loop does: read the weights under the lock
                seen[report.version] = bf16_digest(peer.model)
            reports.append(report)

        peer.sub.follow(peer.model, on_update=on_update, interval=0.1)
        for _ in range(5):
            publish_versions(pub, trainer, 1, expected)
            deadline = time.monotonic() + 30  # until on_update has seen the new version
            while not (reports and reports[-1].version == pub.version) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert peer.sub.version == pub.version
        assert [r.version for r in reports] == [1, 2, 3, 4, 5]
        assert all(seen[v] == expected[v] for v in seen)
    finally:
        if peer is not None:
            peer.close()


@pytest.mark.timeout(90)
def test_a_subscriber_that_starts_from_the_published_checkpoint_downloads_no_anchor(
    start_publisher, bootstrap, key
) -> None:
    """A run's first version is the checkpoint its workers load too: a subscriber whose model already is the head
    (its digest the signed one) takes it as held without fetching the anchor, answers with the head's signed bytes,
    and follows the next version by patch. A subscriber with other weights (or in FP32 through its shadow, the
    same values) is checked the same way; other weights fetch the anchor."""
    from pulseloco.sync.signing import verify_envelope

    peers = maddrs(bootstrap)
    run = RUN + "-local-start"
    pub = start_publisher(run)
    trainer, expected = Trainer(), {}
    same, fp32, other = (InProcessPeer(peers, run, key, timeout=20) for _ in range(3))
    try:
        same.model.load_state_dict({k: v.to(torch.bfloat16) for k, v in trainer.model.state_dict().items()})
        fp32.model = tiny_model(seed=0)  # the trainer's own FP32 initialization: the same BF16 values
        publish_versions(pub, trainer, 1, expected)
        for peer in (same, fp32):
            report = peer.sub.update_report(peer.model)
            assert report is not None and (report.version, report.path, report.bytes_received) == (1, "local", 0)
            assert peer.sub.digest == expected[1] and bf16_digest(peer.model) == expected[1]
            env = verify_envelope(key.public_key(), peer.sub.envelope, run_id=run)
            assert (env.version, env.digest) == (1, expected[1])  # what a worker shows a trainer for its version
        report = other.sub.update_report(other.model)
        assert report is not None and report.path == "anchor" and report.bytes_received > 0
        assert bf16_digest(other.model) == expected[1]
        publish_versions(pub, trainer, 1, expected)
        report = same.sub.update_report(same.model)
        assert report is not None and (report.version, report.path) == (2, "patch")
        assert bf16_digest(same.model) == expected[2]
    finally:
        for peer in (same, fp32, other):
            peer.close()


@pytest.mark.timeout(90)
def test_a_version_no_relay_holds_is_asked_of_the_publisher_without_a_lookup(start_publisher, bootstrap, key) -> None:
    """Once a lookup showed who publishes, the patch of a new version (no relay holds it yet) is fetched from the
    publisher at once, with no provider lookup: a worker woken by a pushed head does not wait for the provider
    record the publisher stores after the push. When the publisher does not have what is asked for, the
    subscriber looks the providers up as before (and, with nobody listing it, gets nothing). A version newer than
    any the provider record lists is asked of the publisher the record names."""
    from pulseloco.sync.transport import FetchRequest

    peers = maddrs(bootstrap)
    run = RUN + "-direct"
    pub = start_publisher(run)
    peer = InProcessPeer(peers, run, key, timeout=20, relay=False)
    try:
        trainer, expected = Trainer(), {}
        publish_versions(pub, trainer, 1, expected)
        source = peer.sub.source
        assert source.publishers == []  # type: ignore[attr-defined]  # a listing alone earns no first try
        assert peer.sub.update(peer.model) == 1  # the anchor, from the providers looked up
        publisher = pub.endpoint.peer_id.to_base58()
        assert source.publishers == [publisher]  # type: ignore[attr-defined]  # it served a verified object
        lookups: list[float] = []
        get_providers = source.endpoint.get_providers  # type: ignore[attr-defined]
        source.endpoint.get_providers = lambda **kw: lookups.append(1) or get_providers(**kw)  # type: ignore[attr-defined]
        publish_versions(pub, trainer, 1, expected)
        report = peer.sub.update_report(peer.model)
        assert report is not None and (report.version, report.path) == (2, "patch")
        assert bf16_digest(peer.model) == expected[2]
        assert lookups == [] and source.served_by[-1] == ("patch", 2, publisher)  # type: ignore[attr-defined]
        assert source.fetch(FetchRequest("patch", 99)) is None  # the publisher has no version 99: looked up
        assert lookups == [1]
        # a version the provider record does not list yet (its store comes after the push): looked up, then asked
        # of the publisher the record names
        unstored: concurrent.futures.Future[bool] = concurrent.futures.Future()
        unstored.set_result(False)  # the provider record landed on no node
        pub.endpoint.announce_provider = lambda *args, **kw: unstored  # type: ignore[method-assign]
        publish_versions(pub, trainer, 1, expected)
        source.publishers = []  # type: ignore[attr-defined]
        fetched = source.fetch(FetchRequest("patch", 3))
        assert fetched is not None and fetched.envelope.version == 3 and lookups == [1, 1]
        assert source.served_by[-1] == ("patch", 3, publisher)  # type: ignore[attr-defined]
    finally:
        peer.close()


@pytest.mark.timeout(90)
def test_a_relay_serves_only_the_squash_that_was_asked_for(
    start_publisher, bootstrap, key, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """R caught up from version 1 to 5 with a squashed patch (1 -> 5) and relays it; S, at version 2, asks for
    the squash 2 -> 5 and must get that one (from the publisher), not R's, which is for another base."""
    peers = maddrs(bootstrap)
    run = RUN + "-squash"
    pub = start_publisher(run, anchor_every=10)
    r = s = None
    try:
        trainer, expected = Trainer(), {}
        r, s = InProcessPeer(peers, run, key, timeout=20), InProcessPeer(peers, run, key, timeout=20)
        publish_versions(pub, trainer, 1, expected)
        assert r.sub.update(r.model) == 1
        publish_versions(pub, trainer, 1, expected)
        assert s.sub.update(s.model) == 2
        publish_versions(pub, trainer, 3, expected)
        report = r.sub.update_report(r.model)
        assert report is not None and (report.version, report.path) == (5, "squash")
        wait_until_provider_lists(s.sub.endpoint, r.sub.endpoint.peer_id.to_base58(), 5)
        with caplog.at_level(logging.WARNING, logger="pulseloco"):
            report = s.sub.update_report(s.model)
        assert report is not None and (report.version, report.path) == (5, "squash")
        assert bf16_digest(s.model) == bf16_digest(r.model) == expected[5]
        assert not [m for m in caplog.messages if "failed" in m], caplog.messages
    finally:
        for p in (r, s):
            if p is not None:
                p.close()


@pytest.mark.timeout(90)
def test_publisher_over_its_upload_budget_serves_when_no_relay_appears(
    start_publisher, bootstrap, key, tmp_path: Path
) -> None:
    """With ``max_uploads_per_version=1`` and subscribers that do not relay, the second one is told ``busy``,
    waits for a relay that never comes, and is then served with ``force``."""
    peers = maddrs(bootstrap)
    run = RUN + "-budget"
    pub = start_publisher(run, max_uploads_per_version=1)
    sub_dht = start_dht(peers)
    subs = [Subscriber(sub_dht, run, key.public_key(), relay=False, timeout=20) for _ in range(2)]
    for sub in subs:
        sub.source.relay_wait = 2.0  # type: ignore[attr-defined]  # SwarmSource's; 10 s by default, for real swarms
    try:
        trainer, expected = Trainer(), {}
        models = [tiny_model(seed=s, dtype=torch.bfloat16) for s in (1, 2)]
        for _ in range(2):
            publish_versions(pub, trainer, 1, expected)
            for sub, model in zip(subs, models):
                assert sub.update(model) == pub.version and bf16_digest(model) == expected[pub.version]
        anchor, patch = len(pub.store.read("anchor", 1)[1]), len(pub.store.read("patch", 2)[1])
        assert pub.bytes_uploaded == 2 * anchor + 2 * patch
    finally:
        for sub in subs:
            sub.close()
        sub_dht.shutdown()


@pytest.mark.timeout(90)
def test_client_mode_subscriber_without_a_relay_address_does_not_announce(
    start_publisher, bootstrap, key, tmp_path: Path
) -> None:
    """A worker in client mode (behind NAT, no relay address) follows, but never appears in the provider record:
    others would try it first for every version and fail. A server-mode worker next to it announces."""
    peers = maddrs(bootstrap)
    run = RUN + "-client-relay"
    pub = start_publisher(run)
    client_dht = hivemind.DHT(start=True, initial_peers=peers, client_mode=True, startup_timeout=30)
    client = Subscriber(client_dht, run, key.public_key(), timeout=20)
    server = InProcessPeer(peers, run, key, timeout=20)
    try:
        trainer, expected = Trainer(), {}
        publish_versions(pub, trainer, 2, expected)
        model = tiny_model(seed=3, dtype=torch.bfloat16)
        assert client.update(model) == 2 and bf16_digest(model) == expected[2]
        assert server.sub.update(server.model) == 2
        assert server.sub.announced and not client.announced
        server_id = server.sub.endpoint.peer_id.to_base58()
        wait_until_provider_lists(pub.endpoint, server_id, 2)
        assert client.endpoint.peer_id.to_base58() not in pub.endpoint.get_providers()
    finally:
        server.close()
        client.close()
        client_dht.shutdown()
