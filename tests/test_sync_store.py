"""PULSESync without the network: signed envelopes, key files, the version store, anchors, the publisher writing
a store (dht=None) and subscribers following a store directory (``Subscriber.from_directory``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from sync_helpers import Trainer, bf16_digest, float_state, tiny_model

from pulseloco.errors import (
    ConfigError,
    DigestMismatchError,
    PatchError,
    PayloadError,
    UnauthorizedError,
)
from pulseloco.sync import apply_patch, state_digest
from pulseloco.sync.anchor import anchor_bytes, load_anchor
from pulseloco.sync.publisher import Publisher, bf16_snapshot
from pulseloco.sync.signing import (
    MAX_ENVELOPE_BYTES,
    Envelope,
    generate_key,
    load_private_key,
    load_public_key,
    public_key_fingerprint,
    save_keypair,
    sign_envelope,
    verify_envelope,
)
from pulseloco.sync.sources import DirectorySource, Fetched, Head
from pulseloco.sync.store import VersionStore
from pulseloco.sync.subscriber import Subscriber
from pulseloco.sync.transport import FetchRequest

RUN = "store-test"

pytestmark = pytest.mark.timeout(60)


def envelope(**overrides) -> Envelope:
    fields = dict(
        run_id=RUN,
        kind="patch",
        version=7,
        base_version=6,
        digest="a" * 32,
        base_digest="b" * 32,
        sha256="c" * 64,
        size=123,
        anchor_version=None,
        time=1.5,
    )
    fields.update(overrides)
    return Envelope(**fields)


@pytest.fixture(scope="module")
def key():
    return generate_key()


# ---- signing -------------------------------------------------------------------------------------------------


def test_envelope_round_trip_and_every_field_is_signed(key) -> None:
    env = envelope()
    blob = sign_envelope(key, env)
    assert verify_envelope(key.public_key(), blob, run_id=RUN) == env
    outer = json.loads(blob)
    for name, value in [("version", 8), ("digest", "d" * 32), ("sha256", "e" * 64), ("size", 124), ("run_id", "x")]:
        tampered = json.dumps({"fields": {**outer["fields"], name: value}, "sig": outer["sig"]}).encode()
        with pytest.raises(UnauthorizedError, match="not signed by the trusted publisher key"):
            verify_envelope(key.public_key(), tampered)


def test_envelopes_that_are_not_the_publishers_are_rejected(key) -> None:
    blob = sign_envelope(key, envelope())
    stranger = generate_key()
    with pytest.raises(UnauthorizedError, match="not signed by the trusted"):
        verify_envelope(stranger.public_key(), blob)
    with pytest.raises(UnauthorizedError, match="not signed by the trusted"):
        verify_envelope(key.public_key(), sign_envelope(stranger, envelope()))
    with pytest.raises(UnauthorizedError, match="expected 'other-run'"):
        verify_envelope(key.public_key(), blob, run_id="other-run")
    unsigned = json.dumps({"fields": dataclasses.asdict(envelope())}).encode()
    with pytest.raises(UnauthorizedError, match="no signature"):
        verify_envelope(key.public_key(), unsigned)
    bad_sig = json.dumps({"fields": dataclasses.asdict(envelope()), "sig": "!!not base64!!"}).encode()
    with pytest.raises(UnauthorizedError):
        verify_envelope(key.public_key(), bad_sig)


@pytest.mark.parametrize(
    "blob",
    [
        b"\xff\xfe not json",
        b"[" * 100_000,
        b"x" * (MAX_ENVELOPE_BYTES + 1),
        json.dumps({"fields": {"run_id": RUN}, "sig": ""}).encode(),
        json.dumps({"fields": {**dataclasses.asdict(envelope()), "version": True}, "sig": ""}).encode(),
        json.dumps({"fields": {**dataclasses.asdict(envelope()), "size": -1}, "sig": ""}).encode(),
        json.dumps({"fields": {**dataclasses.asdict(envelope()), "kind": "tarball"}, "sig": ""}).encode(),
        json.dumps({"fields": {**dataclasses.asdict(envelope()), "digest": "x" * 1000}, "sig": ""}).encode(),
        json.dumps({"fields": {**dataclasses.asdict(envelope()), "extra": 1}, "sig": ""}).encode(),
    ],
    ids=[
        "binary",
        "deep-json",
        "oversized",
        "missing-fields",
        "bool-version",
        "negative-size",
        "bad-kind",
        "long-digest",
        "extra-field",
    ],
)
def test_malformed_envelopes_raise_payload_errors(key, blob: bytes) -> None:
    with pytest.raises(PayloadError):
        verify_envelope(key.public_key(), blob)


def test_sign_refuses_unknown_kinds(key) -> None:
    with pytest.raises(ValueError, match="kind"):
        sign_envelope(key, envelope(kind="tarball"))


def test_key_files(tmp_path: Path) -> None:
    key = generate_key()
    private_path, public_path = save_keypair(key, tmp_path / "publisher.key")
    assert public_path == tmp_path / "publisher.key.pub"
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
    loaded, loaded_public = load_private_key(private_path), load_public_key(public_path)
    assert verify_envelope(loaded_public, sign_envelope(loaded, envelope())) == envelope()
    assert load_public_key(public_path.read_bytes()) is not None
    fingerprint = public_key_fingerprint(loaded_public)
    assert fingerprint == public_key_fingerprint(key.public_key()) and len(fingerprint) == 16
    assert fingerprint != public_key_fingerprint(generate_key().public_key())

    with pytest.raises(ConfigError, match="already exists"):
        save_keypair(generate_key(), private_path)
    assert load_private_key(private_path).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    ) == key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    with pytest.raises(ConfigError, match="cannot read"):
        load_private_key(tmp_path / "missing.key")
    with pytest.raises(ConfigError, match="cannot read"):
        load_public_key(tmp_path / "missing.pub")
    (tmp_path / "garbage").write_text("not a key")
    with pytest.raises(ConfigError, match="pulseloco keygen"):
        load_private_key(tmp_path / "garbage")
    with pytest.raises(ConfigError, match="not a PEM public key"):
        load_public_key(tmp_path / "garbage")
    with pytest.raises(ConfigError, match="not a PEM public key"):
        load_public_key(private_path)  # the private half where the public one belongs
    ec_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.key").write_bytes(
        ec_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (tmp_path / "ec.pub").write_bytes(
        ec_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(ConfigError, match="Ed25519"):
        load_private_key(tmp_path / "ec.key")
    with pytest.raises(ConfigError, match="Ed25519"):
        load_public_key(tmp_path / "ec.pub")


# ---- the version store ---------------------------------------------------------------------------------------


def test_store_write_read_list_and_ready_marker(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "s")
    assert store.latest() is None and store.list("patch") == []
    store.write("anchor", 1, b"A1", b"env-a1")
    store.write("patch", 2, b"P2", b"env-p2")
    store.write("patch", 3, b"P3", b"env-p3")
    assert store.read("patch", 2) == (b"env-p2", b"P2")
    assert store.read_envelope("anchor", 1) == b"env-a1"
    assert store.list("anchor") == [1] and store.list("patch") == [2, 3] and store.latest() == 3
    assert store.has("patch", 3) and not store.has("anchor", 3)
    with pytest.raises(FileNotFoundError):
        store.read("anchor", 3)
    with pytest.raises(ValueError, match="kind"):
        store.has("checkpoint", 1)

    # a payload whose envelope was never written (killed between the two renames) is not READY
    (tmp_path / "s" / "v00000004.patch").write_bytes(b"P4-half")
    # an envelope whose payload is gone (pruned by another process) is not READY either
    (tmp_path / "s" / "v00000005.patch.env").write_bytes(b"env-p5")
    assert store.list("patch") == [2, 3] and store.latest() == 3
    assert not store.has("patch", 4) and not store.has("patch", 5)
    with pytest.raises(FileNotFoundError):
        store.read("patch", 4)
    # rewriting the half-written version completes it
    store.write("patch", 4, b"P4", b"env-p4")
    assert store.read("patch", 4) == (b"env-p4", b"P4") and store.latest() == 4


def test_store_removes_leftover_temporaries_on_open_but_readers_do_not(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    store.write("anchor", 1, b"A1", b"env")
    (tmp_path / "v00000002.patch.tmp").write_bytes(b"half")
    (tmp_path / "v00000002.patch.env.tmp").write_bytes(b"half")
    VersionStore(tmp_path, create=False)  # a reader never deletes a writer's files
    assert (tmp_path / "v00000002.patch.tmp").exists()
    VersionStore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000001.anchor", "v00000001.anchor.env"]


def test_store_write_failure_leaves_the_object_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = VersionStore(tmp_path)
    store.write("patch", 2, b"old", b"env-old")
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(dst).endswith(".env"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space"):
        store.write("patch", 3, b"new", b"env-new")
    monkeypatch.setattr(os, "replace", real_replace)
    assert store.list("patch") == [2] and store.read("patch", 2) == (b"env-old", b"old")


def test_store_survives_a_writer_killed_mid_write(tmp_path: Path) -> None:
    """A real process writing 2 MB objects is SIGKILLed at a random point: every READY object is complete."""
    script = textwrap.dedent(
        f"""
        import sys
        from pulseloco.sync.store import VersionStore
        store = VersionStore({str(tmp_path)!r})
        v = 0
        while True:
            v += 1
            payload = bytes([v % 251]) * (2 << 20)
            store.write("anchor" if v % 5 == 1 else "patch", v, payload, b"env-%d" % v)
            if v == 3:
                print("ready", flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        threading.Event().wait(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    store = VersionStore(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
    latest = store.latest()
    assert latest is not None and latest >= 3
    for kind in ("anchor", "patch"):
        for v in store.list(kind):
            env, payload = store.read(kind, v)
            assert env == b"env-%d" % v and payload == bytes([v % 251]) * (2 << 20)


def test_store_chain_and_retention(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    for v in range(1, 13):
        if v in (1, 5, 9):
            store.write("anchor", v, b"A", b"e")
        if v > 1:
            store.write("patch", v, b"P", b"e")
    assert store.chain_to(12) == (9, [10, 11, 12])
    assert store.chain_to(9) == (9, [])
    assert store.chain_to(7) == (5, [6, 7])
    assert store.prune(5) == [] and store.prune(3) == []
    removed = store.prune(2)  # keep anchors 5 and 9 and every patch after 5
    assert store.list("anchor") == [5, 9] and store.list("patch") == list(range(6, 13))
    assert {p.name for p in removed} >= {"v00000001.anchor", "v00000001.anchor.env", "v00000005.patch"}
    with pytest.raises(PayloadError, match="no anchor"):
        store.chain_to(4)
    (tmp_path / "v00000011.patch.env").unlink()
    with pytest.raises(PayloadError, match="no patch for version 11"):
        store.chain_to(11)
    with pytest.raises(ConfigError, match="keep_anchors"):
        store.prune(0)


def test_store_directory_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot create"):
        VersionStore(tmp_path / "file" / "store")
    with pytest.raises(ConfigError, match="does not exist"):
        VersionStore(tmp_path / "missing", create=False)


# ---- anchors -------------------------------------------------------------------------------------------------


def test_anchor_round_trip_is_bit_exact_and_validated() -> None:
    state = bf16_snapshot(tiny_model())
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -1.5], dtype=torch.bfloat16)
    state["special"] = special
    blob = anchor_bytes(state, metadata={"version": "3"})
    loaded = load_anchor(blob, expected_digest=state_digest(state))
    assert state_digest(loaded) == state_digest(state)
    assert torch.equal(loaded["special"].view(torch.int16), special.view(torch.int16))
    with pytest.raises(DigestMismatchError):
        load_anchor(blob, expected_digest="0" * 32)
    for bad in (b"", b"garbage", blob[: len(blob) // 2], b"\xff" * 8 + blob[8:]):
        with pytest.raises(PayloadError, match="not a valid safetensors"):
            load_anchor(bad)


# ---- the publisher writing a store ---------------------------------------------------------------------------


def publish(pub: Publisher, trainer: Trainer, count: int, expected: dict[int, str]) -> None:
    for _ in range(count):
        if pub.version is not None or expected:
            trainer.step()
        v = pub.publish(trainer.model)
        assert pub.flush(timeout=30) == v, pub.last_error
        expected[v] = trainer.digest()
        assert pub.digest == expected[v]


def replay(store: VersionStore, key, version: int) -> dict[str, torch.Tensor]:
    """The state at ``version`` rebuilt from the store, checking every signature and digest on the way."""
    anchor, patches = store.chain_to(version)
    env_blob, blob = store.read("anchor", anchor)
    state = load_anchor(blob, expected_digest=verify_envelope(key.public_key(), env_blob, run_id=RUN).digest)
    for v in patches:
        env_blob, blob = store.read("patch", v)
        env = verify_envelope(key.public_key(), env_blob, run_id=RUN)
        assert apply_patch(state, blob).digest == env.digest
    return state


def test_publisher_writes_signed_anchors_every_k_versions_with_retention(key, tmp_path: Path) -> None:
    pub = Publisher(None, RUN, key, tmp_path, anchor_every=4, keep_anchors=2)
    trainer, expected = Trainer(), {}
    try:
        publish(pub, trainer, 14, expected)
    finally:
        pub.close()
    store = VersionStore(tmp_path)
    # anchors at 1, 5, 9, 13; retention keeps the newest two and the patches after the older of them
    assert store.list("anchor") == [9, 13]
    assert store.list("patch") == list(range(10, 15))
    for v in range(9, 15):
        assert state_digest(replay(store, key, v)) == expected[v]
    env = verify_envelope(key.public_key(), store.read_envelope("patch", 14), run_id=RUN)
    assert (env.kind, env.version, env.base_version, env.digest, env.base_digest) == (
        "patch",
        14,
        13,
        expected[14],
        expected[13],
    )
    assert pub.bytes_uploaded == 0 and pub.endpoint is None


def test_publisher_restart_resumes_the_chain_after_a_crash_mid_write(key, tmp_path: Path) -> None:
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path, anchor_every=3)
    publish(pub, trainer, 5, expected)
    pub.close()
    # what a publisher killed while writing version 6 leaves: a temporary and a payload without its envelope
    (tmp_path / "v00000006.patch.tmp").write_bytes(b"half a patch")
    (tmp_path / "v00000006.anchor").write_bytes(b"an anchor whose envelope was never written")

    pub = Publisher(None, RUN, key, tmp_path, anchor_every=3)
    try:
        assert (pub.version, pub.digest) == (5, expected[5])
        assert not list(tmp_path.glob("*.tmp"))
        publish(pub, trainer, 3, expected)
        assert pub.version == 8
    finally:
        pub.close()
    store = VersionStore(tmp_path)
    env = verify_envelope(key.public_key(), store.read_envelope("patch", 6), run_id=RUN)
    assert (env.base_version, env.base_digest) == (5, expected[5])
    for v in range(1, 9):
        assert state_digest(replay(store, key, v)) == expected[v]

    with pytest.raises(ConfigError, match="use the key that wrote it"):
        Publisher(None, RUN, generate_key(), tmp_path)
    with pytest.raises(ConfigError, match="use the key that wrote it"):
        Publisher(None, "another-run", key, tmp_path)


def test_a_failed_publish_is_rolled_back_and_never_becomes_the_base(
    key, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path, anchor_every=2)
    try:
        publish(pub, trainer, 2, expected)
        real_write = pub.store.write

        def disk_full(kind, version, payload, envelope):
            if kind == "anchor":  # version 3 writes its patch, then fails on its anchor
                raise OSError(28, "No space left on device")
            real_write(kind, version, payload, envelope)

        monkeypatch.setattr(pub.store, "write", disk_full)
        trainer.step()
        assert pub.publish(trainer.model) == 3
        assert pub.flush(timeout=30) == 2
        assert isinstance(pub.last_error, OSError)
        assert (pub.version, pub.digest, pub.store.latest()) == (2, expected[2], 2)
        assert not (tmp_path / "v00000003.patch").exists()
        monkeypatch.setattr(pub.store, "write", real_write)

        publish(pub, trainer, 1, expected)  # version 4, a patch against version 2
        env = verify_envelope(key.public_key(), pub.store.read_envelope("patch", 4), run_id=RUN)
        assert (env.base_version, env.base_digest) == (2, expected[2])
        assert state_digest(replay(pub.store, key, 4)) == expected[4]

        # a model whose layout changes is refused the same way
        pub.publish({"other": torch.zeros(3)})
        assert pub.flush(timeout=30) == 4 and isinstance(pub.last_error, ConfigError)
    finally:
        pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(trainer.model)


def test_announce_listeners_see_each_stored_version_once_with_its_time_and_never_a_failed_one(
    key, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pulseloco.sync.publisher import PublishedVersion

    seen: list[PublishedVersion] = []
    also: list[int] = []
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path, on_announced=seen.append)
    pub.add_announce_listener(lambda published: also.append(published.version))
    pub.add_announce_listener(lambda published: 1 / 0)  # a failing listener is logged; the others still run
    try:
        publish(pub, trainer, 2, expected)
        monkeypatch.setattr(pub.store, "write", lambda *args: (_ for _ in ()).throw(OSError(28, "disk full")))
        trainer.step()
        pub.publish(trainer.model)
        assert pub.flush(timeout=30) == 2 and isinstance(pub.last_error, OSError)
    finally:
        pub.close()
    assert [(p.version, p.digest, p.announced) for p in seen] == [(1, expected[1], True), (2, expected[2], True)]
    assert also == [1, 2]
    assert (
        seen[0].patch_bytes == 0
        and seen[1].patch_bytes == VersionStore(tmp_path).object_path("patch", 2).stat().st_size
    )
    assert all(0 < p.seconds < 30 for p in seen)


def test_a_newer_version_supersedes_a_queued_one(key, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer()
    pub = Publisher(None, RUN, key, tmp_path)
    started, release = threading.Event(), threading.Event()
    real = pub._publish_one

    def slow_publish_one(version, state):
        started.set()
        assert release.wait(30)
        real(version, state)

    monkeypatch.setattr(pub, "_publish_one", slow_publish_one)
    try:
        assert pub.publish(trainer.model) == 1
        assert started.wait(30)  # the worker holds version 1
        digests = {}
        for v in (2, 3):
            trainer.step()
            assert pub.publish(trainer.model) == v  # returns at once: version 1 is still being encoded
            digests[v] = trainer.digest()
        release.set()
        assert pub.flush(timeout=30) == 3
    finally:
        pub.close()
    assert pub.store.list("patch") == [3] and pub.digest == digests[3]
    assert verify_envelope(key.public_key(), pub.store.read_envelope("patch", 3)).base_version == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(anchor_every=0), "anchor_every"),
        (dict(keep_anchors=0), "keep_anchors"),
        (dict(values="float32"), "values"),
        (dict(run_id=""), "run_id"),
        (dict(run_id="x" * 129), "run_id"),
    ],
)
def test_publisher_configuration_errors(key, tmp_path: Path, kwargs: dict, match: str) -> None:
    run_id = kwargs.pop("run_id", RUN)
    with pytest.raises(ConfigError, match=match):
        Publisher(None, run_id, key, tmp_path, **kwargs)


# ---- subscribers following a store directory ---------------------------------------------------------------


def test_subscriber_follows_a_store_directory(key, tmp_path: Path) -> None:
    """A worker with a BF16 model, one with an FP32 model and one with an empty state dict follow a directory
    written by a publisher: every version, then a jump over several (patch chain), then a jump past retention
    (anchor). Every digest equals the trainer's."""
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path / "store", anchor_every=4, keep_anchors=2)
    try:
        publish(pub, trainer, 1, expected)
        subs = [Subscriber.from_directory(tmp_path / "store", key.public_key(), run_id=RUN) for _ in range(3)]
        models = [tiny_model(seed=7, dtype=torch.bfloat16), tiny_model(seed=8), {}]
        paths: list[list[str]] = [[], [], []]

        def update_all(expected_version: int) -> None:
            for sub, model, log in zip(subs, models, paths):
                report = sub.update_report(model)
                assert report is not None and report.version == sub.version == expected_version
                assert bf16_digest(model) == sub.digest == expected[expected_version]
                log.append(report.path)

        update_all(1)
        for _ in range(3):
            publish(pub, trainer, 1, expected)
            update_all(pub.version)
        publish(pub, trainer, 3, expected)  # 5, 6, 7: a chain of three patches from 4
        update_all(7)
        publish(pub, trainer, 6, expected)  # to 13: retention dropped the patches after 7
        update_all(13)
        assert all(sub.update_report(m) is None for sub, m in zip(subs, models))  # already current
    finally:
        pub.close()
    assert paths[0] == ["anchor", "patch", "patch", "patch", "chain", "anchor"]
    assert paths[1] == paths[2] == paths[0]
    assert float_state(models[1])["model.norm.weight"].dtype == torch.float32  # the FP32 model stays FP32


def test_directory_subscriber_rejects_forged_and_corrupted_objects_and_recovers(key, tmp_path: Path) -> None:
    trainer, expected = Trainer(), {}
    store_dir = tmp_path / "store"
    pub = Publisher(None, RUN, key, store_dir, anchor_every=10)
    try:
        publish(pub, trainer, 2, expected)
        sub = Subscriber.from_directory(store_dir, key.public_key(), run_id=RUN)
        model = tiny_model(seed=3, dtype=torch.bfloat16)
        assert sub.update(model) == 2
        publish(pub, trainer, 2, expected)
        store = VersionStore(store_dir, create=False)

        # a byte flipped on disk in patch 3: the signed SHA-256 catches it; nothing is applied
        patch3 = store_dir / "v00000003.patch"
        good = patch3.read_bytes()
        patch3.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
        with pytest.raises(PatchError, match="could not reach version 4"):
            sub.update(model)
        assert (sub.version, bf16_digest(model)) == (2, expected[2])
        patch3.write_bytes(good)

        # the newest patch replaced by a stranger's (valid patch, valid SHA-256, another key)
        env4 = store.read_envelope("patch", 4)
        stranger = generate_key()
        fields = json.loads(env4)["fields"]
        (store_dir / "v00000004.patch.env").write_bytes(sign_envelope(stranger, Envelope(**fields)))
        with pytest.raises(UnauthorizedError, match="not signed by the trusted"):
            sub.update(model)
        assert (sub.version, bf16_digest(model)) == (2, expected[2])
        (store_dir / "v00000004.patch.env").write_bytes(env4)

        # weights changed behind the subscriber's back: the digest check sends it to an anchor
        with torch.no_grad():
            model.lm_head.weight[0, 0] += 1
        report = sub.update_report(model)
        assert report is not None and (report.version, report.path) == (4, "anchor")
        assert bf16_digest(model) == expected[4]
    finally:
        pub.close()


def test_delta_patches_follow_bit_exactly(key, tmp_path: Path) -> None:
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path / "store", anchor_every=5, values="delta")
    try:
        sub = Subscriber.from_directory(tmp_path / "store", key.public_key(), run_id=RUN)
        state: dict[str, torch.Tensor] = {}
        for _ in range(3):
            publish(pub, trainer, 2, expected)
            assert sub.update(state) == pub.version and state_digest(state) == expected[pub.version]
    finally:
        pub.close()


def test_mirror_restores_the_last_complete_version_after_a_crash(key, tmp_path: Path) -> None:
    """A subscriber keeping a mirror directory is killed (simulated: its half-written next object and temporaries
    are left behind); a new one on the same mirror restores the last complete version without any source, then
    catches up."""
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path / "store", anchor_every=3)
    mirror = tmp_path / "mirror"
    try:
        publish(pub, trainer, 4, expected)
        first = Subscriber.from_directory(tmp_path / "store", key.public_key(), run_id=RUN, mirror_dir=mirror)
        state: dict[str, torch.Tensor] = {}
        assert first.update(state) == 4  # anchor 4
        publish(pub, trainer, 1, expected)
        assert first.update(state) == 5
        (mirror / "v00000006.patch").write_bytes(b"half of version 6")
        (mirror / "v00000006.patch.env.tmp").write_bytes(b"half of its envelope")

        empty = tmp_path / "empty-store"
        VersionStore(empty)
        second = Subscriber.from_directory(empty, key.public_key(), run_id=RUN, mirror_dir=mirror)
        restored: dict[str, torch.Tensor] = {}
        assert second.restore(restored) == 5
        assert state_digest(restored) == second.digest == expected[5]
        assert not list(mirror.glob("*.tmp"))

        third = Subscriber.from_directory(tmp_path / "store", key.public_key(), run_id=RUN, mirror_dir=mirror)
        model = tiny_model(seed=11)  # FP32 model, restored through the BF16 shadow
        assert third.restore(model) == 5 and bf16_digest(model) == expected[5]
        publish(pub, trainer, 2, expected)
        report = third.update_report(model)
        assert report is not None and report.version == 7 and report.path == "chain"
        assert bf16_digest(model) == expected[7]
        assert float_state(model)["lm_head.weight"].dtype == torch.float32

        # a mirror signed by someone else restores nothing
        other = Subscriber.from_directory(empty, generate_key().public_key(), run_id=RUN, mirror_dir=mirror)
        untouched = tiny_model(seed=12, dtype=torch.bfloat16)
        before = bf16_digest(untouched)
        assert other.restore(untouched) is None and bf16_digest(untouched) == before
    finally:
        pub.close()


def test_full_checkpoint_baseline_fetches_every_version_as_an_anchor(key, tmp_path: Path) -> None:
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path / "store", anchor_every=1, keep_anchors=2)
    try:
        sub = Subscriber.from_directory(tmp_path / "store", key.public_key(), run_id=RUN, full_checkpoints=True)
        model = tiny_model(seed=4, dtype=torch.bfloat16)
        for _ in range(3):
            publish(pub, trainer, 1, expected)
            report = sub.update_report(model)
            assert report is not None and report.path == "anchor" and bf16_digest(model) == expected[pub.version]
            assert report.bytes_received == len(pub.store.read("anchor", pub.version)[1])
    finally:
        pub.close()


def test_mirror_restore_checks_each_payload_against_its_signed_sha256(
    key, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Mirrored bytes that differ from the signed ones are refused, with the file named, even where no later check
    would notice: an anchor whose safetensors metadata was altered still holds the same tensors."""
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path / "store", anchor_every=3)
    mirror = tmp_path / "mirror"
    try:
        publish(pub, trainer, 4, expected)  # anchors 1 and 4
        first = Subscriber.from_directory(tmp_path / "store", key.public_key(), run_id=RUN, mirror_dir=mirror)
        assert first.update({}) == 4
    finally:
        pub.close()
    anchor = mirror / "v00000004.anchor"
    good = anchor.read_bytes()
    assert good.count(RUN.encode()) == 1  # in the safetensors header's metadata, outside every tensor
    anchor.write_bytes(good.replace(RUN.encode(), RUN[::-1].encode()))
    assert state_digest(load_anchor(anchor.read_bytes())) == expected[4]  # the tensors still match their digest

    empty = tmp_path / "empty-store"
    VersionStore(empty)
    second = Subscriber.from_directory(empty, key.public_key(), run_id=RUN, mirror_dir=mirror)
    restored: dict[str, torch.Tensor] = {}
    caplog.set_level(logging.WARNING, logger="pulseloco.sync.subscriber")
    assert second.restore(restored) is None and not restored and second.version is None
    assert f"{anchor} is corrupt" in caplog.text and "SHA-256" in caplog.text

    anchor.write_bytes(good[:-10])  # cut short
    caplog.clear()
    assert second.restore(restored) is None and not restored
    assert f"{anchor} is truncated" in caplog.text

    anchor.write_bytes(good)
    assert second.restore(restored) == 4 and state_digest(restored) == expected[4]


def test_update_report_lag_counts_versions_published_while_it_ran(key, tmp_path: Path) -> None:
    """``lag`` is how far the head read after the update is ahead of the version the update reached. That head is
    read when the lag is first asked for, not before the report is handed on (a DHT lookup on a swarm, which a
    rollout worker would otherwise wait out between holding a version and serving it), and read once."""
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path / "store", anchor_every=10)
    try:
        publish(pub, trainer, 2, expected)
        source = DirectorySource(tmp_path / "store", key.public_key(), RUN)
        stale = source.head()  # the head a subscriber saw when it started updating
        publish(pub, trainer, 3, expected)  # versions 3-5 land meanwhile
    finally:
        pub.close()

    class StartedEarlier:
        """The directory's source, whose first head() answer is from before versions 3-5."""

        def __init__(self) -> None:
            self.first = True
            self.reads = 0

        def head(self) -> Head | None:
            self.reads += 1
            if self.first:
                self.first = False
                return stale
            return source.head()

        def fetch(self, request: FetchRequest) -> Fetched | None:
            return source.fetch(request)

    started_earlier = StartedEarlier()
    sub = Subscriber(None, RUN, key.public_key(), source=started_earlier)
    state: dict[str, torch.Tensor] = {}
    report = sub.update_report(state)
    assert report is not None and started_earlier.reads == 1  # the head the update went to, no second read yet
    assert (report.version, report.lag) == (2, 3)
    assert report.lag == 3 and started_earlier.reads == 2  # read once, when asked
    report = sub.update_report(state)
    assert report is not None and (report.version, report.lag, report.path) == (5, 0, "chain")
    assert state_digest(state) == expected[5]


def test_a_head_older_than_the_version_held_is_ignored(key, tmp_path: Path) -> None:
    """A DHT lookup may find an older head record than the one a subscriber followed (a node's stale copy, or a
    head pushed before the DHT stored it): the subscriber stays where it is and fetches nothing. Before, it went
    back, through a full anchor (seen in the rollouts bench: a worker at version 6 fetched version 5's 50 MB
    anchor when the DHT still said 5)."""
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path / "store", anchor_every=10)
    try:
        publish(pub, trainer, 2, expected)
        source = DirectorySource(tmp_path / "store", key.public_key(), RUN)
        old = source.head()
        publish(pub, trainer, 1, expected)
    finally:
        pub.close()
    assert old is not None and old.version == 2

    class Stale:
        """The directory's source; after the first head() answer, the old head, as a stale DHT record."""

        def __init__(self) -> None:
            self.heads = 0
            self.fetched: list[FetchRequest] = []

        def head(self) -> Head | None:
            self.heads += 1
            return source.head() if self.heads == 1 else old

        def fetch(self, request: FetchRequest) -> Fetched | None:
            self.fetched.append(request)
            return source.fetch(request)

    stale = Stale()
    sub = Subscriber(None, RUN, key.public_key(), source=stale)
    state: dict[str, torch.Tensor] = {}
    assert sub.update(state) == 3 and state_digest(state) == expected[3]
    stale.fetched.clear()
    assert sub.update_report(state) is None
    assert sub.version == 3 and state_digest(state) == expected[3] and stale.fetched == []


def test_a_subscriber_without_a_head_says_once_what_it_waits_for(
    key, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    VersionStore(tmp_path / "store")
    sub = Subscriber.from_directory(tmp_path / "store", key.public_key(), run_id="my-run", no_head_warning_after=0)
    caplog.set_level(logging.WARNING, logger="pulseloco.sync.subscriber")
    for _ in range(3):
        assert sub.update_report({}) is None
    waiting = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert len(waiting) == 1, waiting
    assert "'my-run'" in waiting[0] and str(tmp_path / "store") in waiting[0] and "'<run_id>.policy'" in waiting[0]

    patient = Subscriber.from_directory(tmp_path / "store", key.public_key(), run_id="my-run")  # default: 30 s
    caplog.clear()
    assert patient.update_report({}) is None and "waiting for" not in caplog.text


# ---- the publisher serving its store -------------------------------------------------------------------------


def test_publisher_upload_budget_holds_under_concurrent_requests_and_forgets_old_versions(key, tmp_path: Path) -> None:
    """Requests arrive in the transport's executor threads at once: the newest version is still served at most
    ``max_uploads_per_version`` times, and the counts of superseded versions are dropped."""
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path, anchor_every=10, max_uploads_per_version=2)
    try:
        publish(pub, trainer, 2, expected)

        class SlowCounts(dict):
            """Upload counts that are slow to read: widens any window between reading and writing a count."""

            def get(self, *args):
                value = super().get(*args)
                time.sleep(0.05)  # another request's read lands here unless reading and counting are one step
                return value

        pub._uploads = SlowCounts()
        barrier = threading.Barrier(6)
        answers: list[str] = []

        def ask() -> None:
            barrier.wait(10)
            answers.append(pub._provide(FetchRequest("patch", 2)).status)

        threads = [threading.Thread(target=ask) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(answers) == ["busy"] * 4 + ["ok"] * 2
        assert pub._provide(FetchRequest("patch", 2, force=True)).status == "ok"  # force is not budgeted
        assert pub._provide(FetchRequest("patch", 1)).status == "missing"  # version 1 is an anchor only
        assert pub._provide(FetchRequest("anchor", 1)).status == "ok"  # not the newest: not budgeted

        for _ in range(3):
            publish(pub, trainer, 1, expected)
            assert pub._provide(FetchRequest("patch", pub.version)).status == "ok"
        assert dict(pub._uploads) == {5: 1}
    finally:
        pub.close()


def test_publisher_refuses_to_serve_bytes_that_no_longer_match_their_signature(
    key, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path, anchor_every=10, max_uploads_per_version=1)
    try:
        publish(pub, trainer, 4, expected)
        patch3, patch4 = tmp_path / "v00000003.patch", tmp_path / "v00000004.patch"
        good3, good4 = patch3.read_bytes(), patch4.read_bytes()
        patch3.write_bytes(good3[:50] + bytes([good3[50] ^ 1]) + good3[51:])
        patch4.write_bytes(good4[:-7])
        caplog.set_level(logging.ERROR, logger="pulseloco.sync.publisher")

        assert pub._provide(FetchRequest("patch", 3)).status == "missing"
        assert f"{patch3} is corrupt" in caplog.text
        assert pub._provide(FetchRequest("patch", 4)).status == "missing"
        assert f"{patch4} is truncated" in caplog.text
        assert pub._provide(FetchRequest("squash", 4, base_version=2)).status == "missing"  # not squashed either
        assert pub._provide(FetchRequest("patch", 2)).status == "ok"

        patch4.write_bytes(good4)  # a refused request did not use up the newest version's upload budget
        served = pub._provide(FetchRequest("patch", 4))
        assert (served.status, served.payload) == ("ok", good4)
    finally:
        pub.close()


def test_a_damaged_store_is_reported_as_damaged_not_as_a_key_problem(key, tmp_path: Path) -> None:
    trainer, expected = Trainer(), {}
    pub = Publisher(None, RUN, key, tmp_path, anchor_every=10)
    publish(pub, trainer, 2, expected)
    pub.close()
    anchor = tmp_path / "v00000001.anchor"
    anchor.write_bytes(anchor.read_bytes()[:1000])
    with pytest.raises(ConfigError) as info:
        Publisher(None, RUN, key, tmp_path)
    message = str(info.value)
    assert f"{anchor} is truncated" in message and "restore it from a good copy" in message
    assert "use the key that wrote it" not in message


@pytest.mark.parametrize("run_id", ["", "two words", "x" * 101 + ".policy", "tab\t.policy"])
def test_publisher_refuses_a_run_id_the_swarm_keys_refuse(key, tmp_path: Path, run_id: str) -> None:
    # the same rule as every other run id (pulseloco.keys.check_run_id), and nothing written before the refusal
    with pytest.raises(ConfigError, match="run_id must be 1-100 characters without spaces"):
        Publisher(None, run_id, key, tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_publisher_accepts_a_training_runs_policy_id_of_the_longest_run_id(key, tmp_path: Path) -> None:
    Publisher(None, "x" * 100 + ".policy", key, tmp_path).close()
