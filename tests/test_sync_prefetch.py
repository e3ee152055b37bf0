"""A rollout worker downloads the next version while it generates: :meth:`Subscriber.update_report` fetches and
authenticates the catch-up objects without holding :attr:`Subscriber.lock`, and takes the lock only to apply them.

The subscribers here follow a store directory written by a real publisher, through a source that records what it
served and can hold every fetch on a gate (and, like the publisher on the swarm, serve signed squashed patches).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from sync_helpers import Trainer, bf16_digest, tiny_model, wait_for

from pulseloco.sync import squash
from pulseloco.sync.patch import peek_header
from pulseloco.sync.publisher import Publisher
from pulseloco.sync.signing import Envelope, generate_key, sign_envelope, verify_envelope
from pulseloco.sync.sources import DirectorySource, Fetched, Head
from pulseloco.sync.store import VersionStore
from pulseloco.sync.subscriber import Subscriber, UpdateReport
from pulseloco.sync.transport import FetchRequest

RUN = "prefetch-test"
WAIT = 10.0
"""Upper bound for one wait on the updating thread (each normally takes milliseconds)."""

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def key():
    return generate_key()


def publish(pub: Publisher, trainer: Trainer, count: int, expected: dict[int, str]) -> None:
    for _ in range(count):
        if pub.version is not None:
            trainer.step()
        v = pub.publish(trainer.model)
        assert pub.flush(timeout=30) == v, pub.last_error
        expected[v] = trainer.digest()


class GatedSource:
    """The store directory's objects, recorded as served; every fetch waits for ``gate`` (open by default).

    ``squash_offset``: None serves no squashed patches (as a directory); otherwise a squash asked for from base
    ``b`` is made (and signed) from base ``b + squash_offset``, so 0 serves the right one and 1 one that does not
    apply to the subscriber's state.
    """

    def __init__(self, path: Path, key, squash_offset: int | None = None) -> None:
        self.inner = DirectorySource(path, key.public_key(), RUN)
        self.key = key
        self.squash_offset = squash_offset
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.served: list[tuple[str, int]] = []
        self.bytes_served = 0

    def head(self) -> Head | None:
        return self.inner.head()

    def fetch(self, request: FetchRequest) -> Fetched | None:
        self.entered.set()
        if not self.gate.wait(30):
            raise TimeoutError("the test never opened the gate")
        if request.kind == "squash":
            got = None if self.squash_offset is None else self._squash(request)
        else:
            got = self.inner.fetch(request)
        if got is not None:
            self.served.append((got.kind, got.envelope.version))
            self.bytes_served += len(got.payload)
        return got

    def _squash(self, request: FetchRequest) -> Fetched | None:
        assert request.base_version is not None and self.squash_offset is not None
        store: VersionStore = self.inner.store
        base = request.base_version + self.squash_offset
        payload = squash([store.read("patch", v)[1] for v in range(base + 1, request.version + 1)])
        header = peek_header(payload)
        env = Envelope(
            run_id=RUN,
            kind="squash",
            version=request.version,
            base_version=base,
            digest=header.result_digest,
            base_digest=header.base_digest,
            sha256=hashlib.sha256(payload).hexdigest(),
            size=len(payload),
            anchor_version=None,
            time=time.time(),
        )
        blob = sign_envelope(self.key, env)
        return Fetched(verify_envelope(self.key.public_key(), blob, run_id=RUN), blob, payload, "squash")


def start_update(sub: Subscriber, model: torch.nn.Module) -> tuple[threading.Thread, dict[str, object]]:
    """``sub.update_report(model)`` in another thread (the follower); its report or error lands in the dict."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["report"] = sub.update_report(model)
        except Exception as exc:  # handed to the test, which fails on it
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="test-update", daemon=True)
    thread.start()
    return thread, outcome


def finished(thread: threading.Thread, outcome: dict[str, object]) -> UpdateReport:
    thread.join(WAIT)
    assert not thread.is_alive(), "the update did not finish once the lock was free"
    assert "error" not in outcome, outcome["error"]
    report = outcome["report"]
    assert isinstance(report, UpdateReport)
    return report


def at_version_one(tmp_path: Path, key, squash_offset: int | None = None):
    """A publisher with version 1 published, and a subscriber (BF16 model) holding it."""
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path / "store", anchor_every=10)
    publish(pub, trainer, 1, expected)
    source = GatedSource(tmp_path / "store", key, squash_offset)
    sub = Subscriber(None, RUN, key.public_key(), source=source)
    model = tiny_model(seed=5, dtype=torch.bfloat16)
    assert sub.update(model) == 1 and bf16_digest(model) == expected[1]
    source.served.clear()
    source.bytes_served = 0
    return pub, trainer, expected, source, sub, model


@pytest.mark.parametrize(
    ("behind", "squash_offset", "path", "served"),
    [
        (1, None, "patch", [("patch", 2)]),
        (3, None, "chain", [("patch", 4), ("patch", 3), ("patch", 2)]),
        (3, 0, "squash", [("squash", 4)]),
    ],
)
def test_the_next_version_downloads_while_a_rollout_holds_the_lock(
    key, tmp_path: Path, behind: int, squash_offset: int | None, path: str, served: list[tuple[str, int]]
) -> None:
    """While a rollout generates (holding the lock), the update fetches every object it needs and changes
    nothing; once the lock is free it applies them without fetching again."""
    pub, trainer, expected, source, sub, model = at_version_one(tmp_path, key, squash_offset)
    try:
        publish(pub, trainer, behind, expected)
        head = 1 + behind
        with sub.lock:  # a rollout generating with version 1
            thread, outcome = start_update(sub, model)
            wait_for(lambda: source.served == served, WAIT, f"{served} fetched while the lock is held")
            time.sleep(0.2)  # the update now waits for the lock: nothing may be applied meanwhile
            assert thread.is_alive() and not outcome
            assert sub.version == 1 and bf16_digest(model) == expected[1]
        report = finished(thread, outcome)
    finally:
        pub.close()
    assert source.served == served  # nothing fetched again under the lock
    assert (report.version, report.previous, report.path) == (head, 1, path)
    assert report.digest == sub.digest == bf16_digest(model) == expected[head]
    assert report.bytes_received == source.bytes_served > 0
    assert report.changed is not None and report.num_changed > 0


def test_a_fetch_in_progress_leaves_the_lock_to_the_rollout(key, tmp_path: Path) -> None:
    """While the download of the next patch is stalled, another thread takes the lock and reads the previous
    version's weights; the update applies once both the download and the lock are through."""
    pub, trainer, expected, source, sub, model = at_version_one(tmp_path, key)
    try:
        publish(pub, trainer, 1, expected)
        source.gate.clear()
        source.entered.clear()
        thread, outcome = start_update(sub, model)
        try:
            assert source.entered.wait(WAIT), "the update never fetched"
            assert sub.lock.acquire(timeout=2), "update_report holds the lock while it downloads"
            try:
                assert sub.version == 1 and bf16_digest(model) == expected[1]
                source.gate.set()  # the download completes while the rollout still generates
                wait_for(lambda: source.served == [("patch", 2)], WAIT, "patch 2 fetched")
                time.sleep(0.2)
                assert thread.is_alive() and sub.version == 1 and bf16_digest(model) == expected[1]
            finally:
                sub.lock.release()
        finally:
            source.gate.set()
        report = finished(thread, outcome)
    finally:
        pub.close()
    assert (report.version, report.path) == (2, "patch")
    assert report.digest == bf16_digest(model) == expected[2]


def test_a_prefetched_squash_that_does_not_apply_falls_back_to_the_chain(
    key, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A squash that authenticates but is for another base fails its digest check under the lock: the state is
    untouched and the patch chain (fetched then) brings the model to the head, as before prefetching."""
    pub, trainer, expected, source, sub, model = at_version_one(tmp_path, key, squash_offset=1)
    caplog.set_level(logging.WARNING, logger="pulseloco.sync.subscriber")
    try:
        publish(pub, trainer, 3, expected)
        report = sub.update_report(model)
    finally:
        pub.close()
    assert source.served == [("squash", 4), ("patch", 4), ("patch", 3), ("patch", 2)]
    assert report is not None and (report.version, report.path) == (4, "chain")
    assert report.digest == bf16_digest(model) == expected[4]
    assert "catch-up by squash failed" in caplog.text


def test_a_pushed_head_is_checked_and_wakes_the_follow_loop(key, tmp_path: Path) -> None:
    """A head record pushed by the publishing trainer (the signed bytes it stores in the DHT) moves a follower at
    once, not at its next poll (60 s apart here); a forged, foreign, malformed, oversized or old record, or a signed
    envelope of another kind, is refused, changes nothing and does not wake it."""
    import dataclasses

    pub, trainer, expected, _source, sub, model = at_version_one(tmp_path, key)
    heads: list[bytes] = []
    pub.add_announce_listener(lambda published: heads.append(published.head_envelope))
    stop = threading.Event()
    outcome: dict[str, bool] = {}
    thread = threading.Thread(
        target=lambda: outcome.update(ok=sub.run(model, interval=60.0, stop=stop, until_version=2)), daemon=True
    )
    try:
        thread.start()
        time.sleep(0.5)  # its first check found version 1 held: it now waits for its next poll
        publish(pub, trainer, 1, expected)
        (blob,) = heads
        env = verify_envelope(key.public_key(), blob, run_id=RUN)
        assert (env.kind, env.version, env.digest) == ("head", 2, expected[2])
        bad = {
            "forged": sign_envelope(generate_key(), env),
            "another run's": sign_envelope(key, dataclasses.replace(env, run_id="another-run")),
            "a patch envelope": sign_envelope(key, dataclasses.replace(env, kind="patch", base_version=1)),
            "an old head": sign_envelope(key, dataclasses.replace(env, version=1)),
            "malformed": b"\x00{not an envelope",
            "oversized": b"{" + b" " * (64 << 10),
        }
        for what, record in bad.items():
            assert sub.offer_head(record) is False, what
        time.sleep(0.3)
        assert thread.is_alive() and sub.version == 1 and sub.num_pushed == 0
        assert sub.offer_head(blob) is True
        thread.join(WAIT)
        assert not thread.is_alive() and outcome == {"ok": True}
        assert sub.version == 2 and bf16_digest(model) == expected[2] and sub.num_pushed == 1
        assert sub.offer_head(blob) is False  # held already
    finally:
        stop.set()
        thread.join(WAIT)
        pub.close()
