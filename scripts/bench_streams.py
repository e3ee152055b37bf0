#!/usr/bin/env python
"""Count the replies that a libp2p stream loses when the server, not the asker, ends it (the race behind "stream
ended after 0 of N bytes"; docs/design.md section 3.4).

    source .venv/bin/activate
    python scripts/bench_streams.py                         # 2 x 60 s, 8 askers, 2 CPU burners (~2.5 min)
    python scripts/bench_streams.py --seconds 20 --burners 0

What it does: a server process (its own hivemind DHT and daemon on 127.0.0.1) serves the same reply (a JSON
header, then ``--size`` bytes in 256 KiB chunks, as PULSESync's ``rpc_fetch`` does) from two handlers: one that
ends its stream after the reply (hivemind's default) and one under :func:`pulseloco.p2p.asker_closes` (the
stream stays open until the asker closes it). This process (its own DHT and daemon) runs ``--askers`` concurrent
loops against each handler in turn for ``--seconds``, each reading a reply with :func:`pulseloco.p2p.read_stream`
after ``--read-delay`` seconds (an asker whose event loop is busy: the reply waits in its daemon). ``--burners``
processes spin on the CPU meanwhile (the race is lost when a daemon thread is descheduled at the wrong moment).
Reported per handler: replies complete, replies cut short (after how many bytes), other errors.

Output: a table on stdout and ``bench_streams.json`` / ``.md`` in ``--out`` (default: a new folder under
``experiments/benchmarks/results/``). Bad flags exit 2 with argparse's one line; a server that does not start within 60
s raises ``harness.procs.ProcFailed`` (a RuntimeError) with its log."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import typing
from collections import Counter
from pathlib import Path
from typing import Any

import hivemind
from harness import procs
from harness.machine import machine_note
from harness.report import default_out, md_table
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from pulseloco.errors import TruncatedPayloadError
from pulseloco.p2p import P2PHost, asker_closes, read_stream, stream_messages

NAMESPACE = "bench-streams"
HANDLERS = ("server_closes", "asker_closes")


class ReplyServicer(ServicerBase):
    """The same reply from both handlers; only who ends the stream differs."""

    def __init__(self, size: int) -> None:
        self.payload = bytes(size)

    def _messages(self) -> list[runtime_pb2.ExpertResponse]:
        return list(
            stream_messages(runtime_pb2.ExpertResponse, {"status": "ok"}, [self.payload], chunk_bytes=256 << 10)
        )

    async def rpc_server_closes(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:  # hivemind needs typing's alias
        for message in self._messages():
            yield message

    @asker_closes
    async def rpc_asker_closes(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:  # hivemind needs typing's alias
        for message in self._messages():
            yield message


def serve(size: int) -> None:
    """The server process: print the DHT's addresses as one JSON line, then serve until killed."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    host = P2PHost(dht, name="bench-streams-server")
    host.serve(ReplyServicer(size), NAMESPACE)
    print(json.dumps([str(maddr) for maddr in dht.get_visible_maddrs()]), flush=True)
    while True:
        time.sleep(3600)


async def ask_loop(host: P2PHost, peer: PeerID, handler: str, args: argparse.Namespace, outcome: Counter) -> None:
    """Ask ``handler`` again and again until ``args.seconds`` have passed, counting outcomes in ``outcome``."""
    stub = ReplyServicer.get_stub(host.p2p, peer, namespace=NAMESPACE)
    call = getattr(stub, f"rpc_{handler}")
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        try:
            stream = await asyncio.wait_for(call(runtime_pb2.ExpertRequest()), 30)
            if args.read_delay:
                await asyncio.sleep(args.read_delay)
            _, payload = await read_stream(stream, max_bytes=args.size, timeout=30)
            outcome["complete" if len(payload) == args.size else "wrong size"] += 1
        except TruncatedPayloadError as exc:
            outcome[f"cut short: {str(exc).split(' of ')[0].removeprefix('the ')}"] += 1
        except Exception as exc:  # reported, not hidden: a reset can surface as a daemon or connection error
            outcome[f"{type(exc).__name__}: {str(exc)[:60]}"] += 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server and the burners, ask each handler in turn, stop everything (each started process's whole
    group: the server's DHT process and daemon too); the results."""
    host = dht = None
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as logs, procs.Runner(Path(logs)) as runner:
        try:
            server = runner.start("server", [sys.executable, __file__, "--serve", "--size", str(args.size)])
            maddrs = json.loads(server.wait_for(r"(?m)^(\[.*\])$", timeout=60).group(1))
            peer = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])
            dht = hivemind.DHT(start=True, initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            host = P2PHost(dht, name="bench-streams-asker")
            for i in range(args.burners):
                runner.start(f"burner{i}", [sys.executable, "-c", "while True: pass"])
            results: dict[str, dict[str, int]] = {}
            for handler in HANDLERS:
                outcome: Counter = Counter()

                async def ask_all(handler: str = handler, outcome: Counter = outcome) -> None:
                    await asyncio.gather(*(ask_loop(host, peer, handler, args, outcome) for _ in range(args.askers)))

                host.run(ask_all(), timeout=args.seconds + 120)
                results[handler] = dict(outcome)
                print(f"{handler}: {dict(outcome)}", flush=True)
            return {"args": vars(args), "machine": machine_note(), "results": results}
        finally:
            runner.stop_all(grace=0)  # the burners first of all: they hold the cores the shutdown needs
            if host is not None:
                host.close()
            if dht is not None:
                dht.shutdown()


def report(data: dict[str, Any]) -> str:
    """The results as a markdown table: one row per handler."""
    rows = []
    for handler, outcome in data["results"].items():
        total = sum(outcome.values())
        complete = outcome.get("complete", 0)
        failed = {k: v for k, v in outcome.items() if k != "complete"}
        rows.append(
            [
                handler,
                str(total),
                str(complete),
                f"{total - complete} ({100 * (total - complete) / max(total, 1):.2f}%)",
                "; ".join(f"{k}: {v}" for k, v in sorted(failed.items())) or "-",
            ]
        )
    args = data["args"]
    head = (
        f"{args['askers']} askers x {args['seconds']:.0f} s per handler, replies of {args['size']} bytes, "
        f"read delay {args['read_delay']} s, {args['burners']} CPU burners; {data['machine']}\n\n"
    )
    return head + md_table(["handler", "replies", "complete", "lost", "how"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="asking time per handler (default 60)")
    parser.add_argument("--askers", type=int, default=8, help="concurrent askers (default 8)")
    parser.add_argument("--size", type=int, default=216_336, help="reply bytes (default 216336)")
    parser.add_argument("--read-delay", type=float, default=0.02, help="seconds before reading a reply (0.02)")
    parser.add_argument("--burners", type=int, default=2, help="CPU-spinning processes meanwhile (default 2)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: a new folder experiments/benchmarks/results/bench-streams-ASKERSaskers-STAMP)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.askers < 1 or args.size < 0 or args.read_delay < 0 or args.burners < 0:
        parser.error("--seconds must be > 0, --askers >= 1, --size, --read-delay and --burners >= 0")
    if args.serve:
        serve(args.size)
        return
    if args.out is None:
        args.out = default_out("benchmarks", f"bench-streams-{args.askers}askers")
    data = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_streams.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    table = report(data)
    (args.out / "bench_streams.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
