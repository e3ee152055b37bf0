"""``pulseloco keygen``, ``pulseloco sync serve`` and ``pulseloco sync follow`` run as subprocesses, the way an
operator runs them, on a real swarm on 127.0.0.1 (a bootstrap DHT in the test process)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from sync_helpers import (
    FOLLOW_LINE,
    RESTORED_LINE,
    LineReader,
    Trainer,
    maddrs,
    popen,
    start_dht,
)

from pulseloco.cli import main
from pulseloco.keys import policy_run_id
from pulseloco.sync.publisher import Publisher
from pulseloco.sync.signing import generate_key, load_private_key, save_keypair

CLI = [sys.executable, "-m", "pulseloco.cli"]
RUN = "cli-test"


@pytest.fixture(scope="module")
def bootstrap():
    dht = start_dht()
    yield dht
    dht.shutdown()


@pytest.fixture
def keypair(tmp_path: Path) -> tuple[Path, Path]:
    return save_keypair(generate_key(), tmp_path / "publisher.key")


def run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def follow_lines(reader: LineReader) -> list[tuple[int, str, str]]:
    """(version, digest, path) of every per-version line a follower printed."""
    out = []
    for line in reader.lines:
        m = FOLLOW_LINE.match(line)
        if m:
            out.append((int(m.group(1)), m.group(5), m.group(7)))
    return out


def test_keygen_writes_a_private_key_only_its_owner_reads_and_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "keys" / "publisher.key"
    out.parent.mkdir()
    result = run([*CLI, "keygen", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    assert f"private key: {out}" in result.stdout and f"--public-key {out}.pub" in result.stdout
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    load_private_key(out)
    before = out.read_bytes()
    again = run([*CLI, "keygen", "--out", str(out)])
    assert again.returncode == 1 and "already exists" in again.stderr and "Traceback" not in again.stderr
    assert out.read_bytes() == before


def test_keygen_does_not_import_torch(tmp_path: Path) -> None:
    """``pulseloco keygen`` needs only the signing code: ``pulseloco.sync`` loads torch on first use of a name that
    needs it (3 CPU-s per command otherwise; benchmarks and the suite start it before every swarm)."""
    code = "import sys; from pulseloco.cli import main; code = main(sys.argv[1:]); print('torch' in sys.modules, code)"
    result = run([sys.executable, "-c", code, "keygen", "--out", str(tmp_path / "k")])
    assert result.stdout.splitlines()[-1] == "False 0", result.stdout + result.stderr


def test_keygen_creates_missing_directories_and_keys_dir_is_ignored_by_git(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "keys" / "team" / "publisher"
    assert main(["keygen", "--out", str(out)]) == 0, capsys.readouterr().err
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert stat.S_IMODE(out.parent.stat().st_mode) & 0o077 == 0  # a directory made for keys: owner only
    load_private_key(out)
    assert (tmp_path / "keys" / "team" / "publisher.pub").is_file()

    (tmp_path / "file").write_text("not a directory")
    assert main(["keygen", "--out", str(tmp_path / "file" / "publisher")]) == 1
    err = capsys.readouterr().err
    assert "cannot create the key directory" in err and "Traceback" not in err

    repo = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("no git checkout to check .gitignore against")
    ignored = run(["git", "-C", str(repo), "check-ignore", "--no-index", "keys/publisher", "keys/publisher.pub"])
    assert ignored.stdout.split() == ["keys/publisher", "keys/publisher.pub"], ignored


def test_sync_serve_refuses_a_store_that_does_not_exist_unless_asked_to_create_it(
    tmp_path: Path, keypair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    private, _ = keypair
    typo = tmp_path / "stroe"
    assert main(["sync", "serve", "--store", str(typo), "--run-id", RUN, "--key", str(private)]) == 1
    err = capsys.readouterr().err
    assert f"store directory {typo} does not exist" in err and "--create-store" in err
    assert len(err.strip().splitlines()) == 1 and not typo.exists()

    (tmp_path / "file").write_text("")
    assert main(["sync", "serve", "--store", str(tmp_path / "file"), "--run-id", RUN, "--key", str(private)]) == 1
    assert "is not a directory" in capsys.readouterr().err

    assert main(["sync", "serve", "--help"]) == 0
    assert "--create-store" in capsys.readouterr().out


def test_sync_serve_reports_a_truncated_anchor_as_a_damaged_store(
    tmp_path: Path, keypair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    private, _ = keypair
    store = tmp_path / "store"
    writer = Publisher(None, policy_run_id(RUN), load_private_key(private), store)  # as a trainer writes it
    trainer = Trainer()
    writer.publish(trainer.model)
    assert writer.flush(timeout=30) == 1
    writer.close()
    anchor = store / "v00000001.anchor"
    anchor.write_bytes(anchor.read_bytes()[:1000])

    argv = ["sync", "serve", "--store", str(store), "--run-id", RUN, "--key", str(private)]
    assert main([*argv, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]) == 1
    err = capsys.readouterr().err
    assert f"{anchor} is truncated" in err and "restore it from a good copy" in err, err
    assert "use the key that wrote it" not in err and "Traceback" not in err


def test_sync_commands_report_configuration_errors(
    tmp_path: Path, keypair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    private, public = keypair
    peer = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWSUv6RDo1yngDi6Yh348fY7TK29SJccKC7tx6mj3fePhm"
    cases = [
        (
            ["sync", "follow", "--run-id", RUN, "--public-key", str(tmp_path / "nope.pub"), "--initial-peers", peer],
            "cannot read public key",
        ),
        (
            ["sync", "follow", "--run-id", RUN, "--public-key", str(private), "--initial-peers", peer],
            "not a PEM public key",
        ),
        (["sync", "follow", "--run-id", RUN, "--public-key", str(public)], "--initial-peers is required"),
        (
            ["sync", "follow", "--run-id", RUN, "--public-key", str(public), "--initial-peers", "not-a-maddr"],
            "is not a multiaddr",
        ),
        (
            ["sync", "serve", "--store", str(tmp_path / "s"), "--run-id", RUN, "--key", str(public)],
            "not an unencrypted PEM private key",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert main(["sync", "follow", "--run-id", RUN]) == 2  # argparse: --public-key is required
    assert "--public-key" in capsys.readouterr().err


@pytest.mark.timeout(150)
def test_serve_and_follow_across_a_publisher_restart(bootstrap, tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    """A trainer writes a store; ``sync serve`` publishes it, a ``sync follow`` process prints every version with
    the trainer's digest. ``sync serve`` is stopped and started again on the same store: the follower continues
    by patch (the chain goes on) and exits at ``--until-version``."""
    private, public = keypair
    key = load_private_key(private)
    store = tmp_path / "store"
    peers = maddrs(bootstrap)
    writer = Publisher(None, policy_run_id(RUN), key, store, anchor_every=3)
    trainer, expected = Trainer(), {}

    def publish() -> int:
        if writer.version is not None:
            trainer.step()
        v = writer.publish(trainer.model)
        assert writer.flush(timeout=30) == v
        expected[v] = trainer.digest()
        return v

    serve_cmd = [*CLI, "sync", "serve", "--store", str(store), "--run-id", RUN, "--key", str(private)]
    serve_cmd += ["--poll", "0.2", "--initial-peers", *peers]
    follow_cmd = [*CLI, "sync", "follow", "--run-id", RUN, "--public-key", str(public), "--initial-peers", *peers]
    follow_cmd += ["--interval", "0.2", "--timeout", "30", "--until-version", "8"]
    logs = [open(tmp_path / f"{name}.log", "w") for name in ("serve1", "serve2", "follow")]  # noqa: SIM115
    try:
        publish()
        with popen(serve_cmd, stderr=logs[0]) as serve, popen(follow_cmd, stderr=logs[2]) as follower:
            serving, reader = LineReader(serve), LineReader(follower)
            serving.wait_for(r"^serving run=cli-test\.policy at /ip4/127\.0\.0\.1/")
            serving.wait_for(rf"^version=1 digest={expected[1]}$")
            for v in range(1, 5):
                if v > 1:
                    publish()
                    serving.wait_for(rf"^version={v} digest={expected[v]}$")
                reader.wait_for(rf"^{v} \d+ \d+ [\d.]+ {expected[v]} \d+ \w+$")
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(30) == 0

            for _ in range(3):  # versions 5-7 are written while nobody serves them
                publish()
            with popen(serve_cmd, stderr=logs[1]) as serve2:
                restarted = LineReader(serve2)
                restarted.wait_for(rf"^version=7 digest={expected[7]}$")
                publish()
                restarted.wait_for(rf"^version=8 digest={expected[8]}$")
                reader.wait_for(rf"^8 \d+ \d+ [\d.]+ {expected[8]} \d+ \w+$")
                assert follower.wait(30) == 0  # --until-version 8
                reader.join()
                serve2.send_signal(signal.SIGTERM)
                assert serve2.wait(30) == 0
    finally:
        writer.close()
        for log in logs:
            log.close()
    lines = follow_lines(reader)
    assert [v for v, _, _ in lines][:4] == [1, 2, 3, 4] and lines[-1][0] == 8
    assert all(digest == expected[v] for v, digest, _ in lines)
    assert lines[0][2] == "anchor"
    assert all(path in ("patch", "squash", "chain") for v, _, path in lines[1:]), lines  # never a new anchor
    assert reader.lines[0] == "version changed bytes seconds digest lag path"


@pytest.mark.timeout(150)
def test_a_follower_killed_mid_update_restarts_from_a_consistent_state(
    bootstrap, tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    """``sync follow --out DIR`` is SIGKILLed while versions are being published; restarted on the same DIR it
    restores a version the publisher published (digest equal), then reaches the newest. A third start, already
    at ``--until-version``, restores it and exits."""
    private, public = keypair
    key = load_private_key(private)
    peers = maddrs(bootstrap)
    pub_dht = start_dht(peers)
    # the run a trainer publishes (RUN-kill.policy); `sync follow --run-id RUN-kill` follows it
    pub = Publisher(pub_dht, policy_run_id(RUN + "-kill"), key, tmp_path / "store", anchor_every=4, keep_anchors=10)
    trainer, expected = Trainer(), {}
    stop, follower_ready, killed = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def trainer_loop() -> None:
        """Publish a version every ~0.1 s, until three versions after the follower was killed."""
        try:
            until = None
            while until is None or pub.version < until:
                if pub.version is not None:
                    trainer.step()
                v = pub.publish(trainer.model)
                assert pub.flush(timeout=30) == v
                expected[v] = trainer.digest()
                if v == 4 and not follower_ready.wait(60):
                    raise AssertionError("the follower did not reach version 3")
                if until is None and killed.is_set():
                    until = v + 3
                if v >= 40:
                    raise AssertionError("the follower was not killed by version 40")
                if stop.wait(0.1):
                    return
        except BaseException as exc:
            errors.append(exc)

    out = tmp_path / "mirror"
    follow_cmd = [*CLI, "sync", "follow", "--run-id", RUN + "-kill", "--public-key", str(public)]
    follow_cmd += ["--initial-peers", *peers, "--interval", "0.05", "--timeout", "30", "--out", str(out)]
    logs = [open(tmp_path / f"follow{i}.log", "w") for i in range(3)]  # noqa: SIM115
    thread = threading.Thread(target=trainer_loop, daemon=True)
    try:
        with popen(follow_cmd, stderr=logs[0]) as first:
            reader = LineReader(first)
            reader.wait_for(r"^version changed bytes")  # it joined the swarm
            thread.start()
            reader.wait_for(r"^[34] \d+ \d+ [\d.]+ [0-9a-f]{32} \d+ \w+$")
            follower_ready.set()
            reader.wait_for(r"^([6-9]|1\d) \d+ \d+ [\d.]+ [0-9a-f]{32} \d+ \w+$")
            # SIGKILL while the trainer keeps publishing. The follower's DHT process and libp2p daemon outlive it
            # (orphans, out of the reaper's sight): end them too, as a supervisor restarting a worker would.
            orphans = psutil.Process(first.pid).children(recursive=True)
            first.send_signal(signal.SIGKILL)
            killed_during_publishing = thread.is_alive()
            killed.set()
            first.wait(30)
            for orphan in orphans:
                with contextlib.suppress(psutil.NoSuchProcess):
                    orphan.kill()
            psutil.wait_procs(orphans, timeout=10)
        thread.join(timeout=60)
        assert not thread.is_alive() and not errors, errors
        assert killed_during_publishing
        last = pub.version

        with popen([*follow_cmd, "--until-version", str(last)], stderr=logs[1]) as second:
            reader2 = LineReader(second)
            m = reader2.wait_for(RESTORED_LINE)
            restored, digest = int(m.group(1)), m.group(2)
            assert restored >= 5 and digest == expected[restored], "the restored state is not a published version"
            reader2.wait_for(rf"^{last} \d+ \d+ [\d.]+ {expected[last]} 0 \w+$")
            assert second.wait(30) == 0
            reader2.join()
        lines = follow_lines(reader2)
        assert all(d == expected[v] for v, d, _ in lines)
        assert lines[0][2] != "anchor", "the restored state was not used as the base of the next update"

        with popen([*follow_cmd, "--until-version", str(last)], stderr=logs[2]) as third:
            reader3 = LineReader(third)
            m = reader3.wait_for(RESTORED_LINE)
            assert (int(m.group(1)), m.group(2)) == (last, expected[last])
            assert third.wait(30) == 0
    finally:
        stop.set()
        follower_ready.set()
        killed.set()
        if thread.is_alive():
            thread.join(timeout=30)
        pub.close()
        pub_dht.shutdown()
        for log in logs:
            log.close()
