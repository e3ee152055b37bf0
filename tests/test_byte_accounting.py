"""Byte accounting users can compare with the paper: the split of the bytes a peer sends into index,
value, shard-sum and header bytes, the payload (the whole selection as one frame), and the per-entry summary.

Hand-checked small cases: one frame's sections against its length; two real :class:`SparseAverager` peers over
hivemind DHTs on 127.0.0.1 (small chunks, so that messages cut frame sections) whose every message is recomputed
here from the codec and the stream protocol; :func:`traffic_summary` on hand-written records.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hivemind
import numpy as np
import pytest
import torch
from hivemind.proto import runtime_pb2

from pulseloco.codec import peek_header
from pulseloco.codec.frame import header_text
from pulseloco.codec.indices import encode_indices
from pulseloco.loco import RoundConfig
from pulseloco.loco.averaging import AllReduceResult, SparseAverager, shard_bounds
from pulseloco.loco.matchmaking import Group
from pulseloco.loco.metrics import RoundMetrics, index_entropy_bits, traffic_summary
from pulseloco.loco.optimizer import PulseLoCo
from pulseloco.loco.shard_owner import AGGREGATE_NAME, CONTRIBUTION_NAME, compact_header
from pulseloco.loco.traffic import FrameLayout, Traffic
from pulseloco.loco.validation import decode_sparse, encode_sparse
from pulseloco.p2p import header_message, stream_messages

NUMEL = 1000
CHUNK = 48
"""Small chunks: frame sections start and end inside messages."""

SPLIT = ("sent_index_bytes", "sent_value_bytes", "sent_sum_index_bytes", "sent_sum_value_bytes", "sent_header_bytes")


def test_a_frames_sections_add_up_to_its_length_and_split_exactly_by_chunk() -> None:
    indices, values = torch.tensor([1, 5]), torch.tensor([1.0, -2.0])
    frame = encode_sparse(CONTRIBUTION_NAME, 8, indices, values, round_index=0)
    header = peek_header(frame)
    flags, stored = int.from_bytes(frame[6:8], "little"), frame[12 : header.header_bytes]  # after magic, format
    header_json = json.loads(header_text(stored, flags))  # the header, zstd-compressed where shorter (format 4)
    assert header.header_bytes == 4 + 2 + 2 + 4 + len(stored)
    assert len(stored) <= len(json.dumps(header_json, separators=(",", ":")))
    assert header.index_bytes == len(encode_indices(np.array([1, 5]), 8).data)
    assert header.value_bytes == 8 and header_json["value_section"]["codec"] == "raw"  # 2 FP32, too few to zstd
    assert len(frame) == header.header_bytes + header.index_bytes + header.value_bytes + 8  # xxh3-64 checksum
    layout = FrameLayout.of(frame)
    assert layout.num_entries == 2
    for chunk in (1, 3, 7, len(frame)):
        splits = [layout.split(start, min(start + chunk, len(frame))) for start in range(0, len(frame), chunk)]
        assert sum(index for index, _ in splits) == header.index_bytes
        assert sum(value for _, value in splits) == header.value_bytes
    # A protobuf message carrying L bytes of metadata is L plus its tag (1 byte) and its length (a varint).
    assert runtime_pb2.ExpertRequest(metadata=b"x" * 100).ByteSize() == 102
    assert runtime_pb2.ExpertRequest(metadata=b"x" * 200).ByteSize() == 203


def test_every_message_sent_is_split_by_the_bytes_it_carries() -> None:
    gen = torch.Generator().manual_seed(0)
    indices = torch.randperm(500, generator=gen)[:60].sort().values
    frame = encode_sparse(CONTRIBUTION_NAME, 500, indices, torch.randn(60, generator=gen), round_index=4)
    header = peek_header(frame)
    start, stop = header.header_bytes, header.header_bytes + header.index_bytes
    # One label per byte of the frame: h(eader, checksum), i(ndex section), v(alue section).
    labels = "h" * start + "i" * header.index_bytes + "v" * header.value_bytes + "h" * 8
    assert len(labels) == len(frame)
    averager = SparseAverager.__new__(SparseAverager)  # only the counters: no DHT, no host
    averager._traffic = {}
    messages = stream_messages(runtime_pb2.ExpertRequest, {"round": 4}, [frame], chunk_bytes=CHUNK)
    offset, before = 0, Traffic()
    for i, message in enumerate(averager._counted(4, messages, FrameLayout.of(frame), is_sum=False)):
        now = averager._traffic[4]
        carried = labels[offset : offset + len(message.metadata)] if i else ""  # message 0: the stream's header
        offset += len(carried)
        assert now.sent - before.sent == message.ByteSize()
        assert now.sent_index - before.sent_index == carried.count("i")
        assert now.sent_value - before.sent_value == carried.count("v")
        assert now.sent_header - before.sent_header == message.ByteSize() - len(carried) + carried.count("h")
        before = dataclasses.replace(now)
    assert offset == len(frame) and averager._traffic[4].num_pushed == 60
    assert (before.sent_index, before.sent_value) == (stop - start, header.value_bytes)


def test_index_entropy_bound_on_a_tiny_case() -> None:
    assert index_entropy_bits(8, 2) == pytest.approx(math.log2(28))  # C(8, 2) = 28 equally likely sets
    assert index_entropy_bits(8, 2) / 2 == pytest.approx(2.4037, abs=1e-4)
    assert index_entropy_bits(8, 0) == 0 and index_entropy_bits(8, 8) == pytest.approx(0, abs=1e-9)
    with pytest.raises(ValueError):
        index_entropy_bits(8, 9)


def test_traffic_summary_on_hand_written_records() -> None:
    new = {"numel": 8, "bytes_received": 0, "payload_index_bytes": 1, "payload_value_bytes": 8}
    records: list[dict[str, Any]] = [
        {**new, "num_sent": 2, "bytes_sent": 100, "payload_bytes": 60, "sent_index_bytes": 1, "sent_value_bytes": 4,
         "sent_sum_bytes": 15, "sent_sum_index_bytes": 3, "sent_sum_value_bytes": 12, "sent_header_bytes": 80,
         "num_pushed": 1, "num_sum_entries": 3},
        {**new, "num_sent": 2, "bytes_sent": 140, "payload_bytes": 60, "sent_index_bytes": 1, "sent_value_bytes": 4,
         "sent_sum_bytes": 25, "sent_sum_index_bytes": 5, "sent_sum_value_bytes": 20, "sent_header_bytes": 110,
         "num_pushed": 1, "num_sum_entries": 5},
    ]  # fmt: skip
    s = traffic_summary(records)
    assert s["rounds"] == 2 and s["bytes_sent"] == 240 and s["num_sent"] == 4 and s["payload_bytes"] == 120
    assert s["sent_index_bytes"] + s["sent_value_bytes"] + s["sent_sum_bytes"] + s["sent_header_bytes"] == 240
    assert s["wire_bytes_per_entry"] == 60.0 and s["payload_bytes_per_entry"] == 30.0
    assert s["header_bytes_per_entry"] == 47.5  # 190 / 4
    assert s["index_bits_per_entry"] == 8.0 and s["value_bytes_per_entry"] == 4.0  # 2 bytes, 8 bytes / 2 pushed
    assert s["sum_bytes_per_entry"] == 5.0  # 40 bytes / 8 union entries
    assert s["sum_index_bits_per_entry"] == 8.0 and s["sum_value_bytes_per_entry"] == 4.0
    assert s["payload_index_bits_per_entry"] == 4.0  # 2 bytes over 4 selected entries
    assert s["index_bound_bits_per_entry"] == pytest.approx(math.log2(28) / 2)
    # A record written before the split existed: those totals are unknown, the old ones still add up.
    old = {"numel": 8, "num_sent": 2, "bytes_sent": 60, "bytes_received": 50}
    s = traffic_summary([*records, old])
    assert s["bytes_sent"] == 300 and s["num_sent"] == 6 and s["wire_bytes_per_entry"] == 50.0
    assert s["payload_bytes"] is None and s["sent_header_bytes"] is None and s["index_bits_per_entry"] is None
    assert s["index_bound_bits_per_entry"] == pytest.approx(math.log2(28) / 2)
    assert traffic_summary([])["wire_bytes_per_entry"] is None
    # Old lines still load as RoundMetrics (the new fields have defaults).
    fields = {"round": 0, "num_peers": 1, "density": 0.25, "num_returned": 0, "num_rejected": 0, "loss": None,
              "seconds_inner": 0.0, "seconds_sync": 0.0, "theta_digest": "", "repaired": False}  # fmt: skip
    assert RoundMetrics(**fields, **old).payload_bytes == 0


def test_a_peer_alone_records_its_payload() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = PulseLoCo(model, None, round_config=RoundConfig(inner_steps=1, selector="dense"))
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    model(torch.randn(3, 6)).square().sum().backward()
    inner.step()
    local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    metrics = opt.count_inner_step()
    assert metrics is not None and metrics.bytes_sent == 0 and metrics.num_sent == 28
    frame = encode_sparse(CONTRIBUTION_NAME, 28, torch.arange(28), theta - local, round_index=0)
    assert metrics.payload_bytes == len(frame)
    assert metrics.payload_index_bytes == 0  # every entry: the "all" index method, no bytes (DiLoCo)
    assert metrics.payload_value_bytes == peek_header(frame).value_bytes


@pytest.fixture(scope="module")
def averagers() -> Iterator[list[SparseAverager]]:
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    dhts = [first]
    made: list[SparseAverager] = []
    try:
        dhts.append(
            hivemind.DHT(
                initial_peers=[str(a) for a in first.get_visible_maddrs()],
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                start=True,
            )
        )
        for dht in dhts:
            made.append(
                SparseAverager(
                    dht,
                    run_id="bytes",
                    numel=NUMEL,
                    client_mode=False,
                    averaging_timeout=10.0,
                    request_timeout=5.0,
                    max_norm_ratio=1e6,
                    clip_to_median=False,  # the sums are plain sums (clipping: tests/test_loco_robust.py)
                    chunk_bytes=CHUNK,
                )
            )
        yield sorted(made, key=lambda a: a.peer_id)
    finally:
        for averager in made:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def _all_reduce(
    peers: list[SparseAverager], round_index: int, selections: list[tuple[torch.Tensor, torch.Tensor]], dtype: str
) -> list[AllReduceResult]:
    ids = tuple(a.peer_id for a in peers)
    group = Group(round=round_index, members=ids, servers=ids)
    with ThreadPoolExecutor(len(peers)) as pool:
        futures = [pool.submit(a.all_reduce, group, i, v, dtype) for a, (i, v) in zip(peers, selections, strict=True)]
        return [f.result(timeout=60) for f in futures]


def _size(messages: Iterator[Any]) -> int:
    return sum(m.ByteSize() for m in messages)


def _overhead(messages: Iterator[Any], frame: bytes) -> int:
    """The header bytes of one stream of ``frame``: the JSON header message, each chunk's protobuf tag and length,
    and the frame's own prefix, JSON header and checksum."""
    first, *chunks = list(messages)
    sections = peek_header(frame)
    protobuf = sum(m.ByteSize() - len(m.metadata) for m in chunks)
    return first.ByteSize() + protobuf + len(frame) - sections.index_bytes - sections.value_bytes


def _expected(
    peers: list[SparseAverager], round_index: int, selections: list[tuple[torch.Tensor, torch.Tensor]], dtype: str
) -> list[dict[str, int]]:
    """Every message each peer sends in a round of two, rebuilt from the codec and the stream protocol."""
    ids = [a.peer_id for a in peers]
    group_id = Group(round=round_index, members=tuple(ids), servers=tuple(ids)).group_id
    bounds = shard_bounds(NUMEL, len(ids))
    parts = []  # parts[p][j]: peer p's frame for shard j
    for indices, values in selections:
        row = []
        for start, stop in bounds:
            mask = (indices >= start) & (indices < stop)
            row.append(encode_sparse(CONTRIBUTION_NAME, stop - start, indices[mask] - start, values[mask],
                                     round_index=round_index, value_dtype=dtype))  # fmt: skip
        parts.append(row)
    sums = []
    for j, (start, stop) in enumerate(bounds):
        total, touched = torch.zeros(stop - start), torch.zeros(stop - start, dtype=torch.bool)
        for p in range(len(ids)):  # sorted peer-id order, as the owner sums
            indices, values = decode_sparse(parts[p][j], CONTRIBUTION_NAME, stop - start)
            total[indices] += values
            touched[indices] = True
        union = torch.nonzero(touched).reshape(-1)
        sums.append(encode_sparse(AGGREGATE_NAME, stop - start, union, total[union], round_index=round_index))
    out = []
    for p in range(len(ids)):
        k = 1 - p  # the other owner's shard (peer p owns shard p)
        base = {"round": round_index, "group": group_id, "shard": k}
        part, served = peek_header(parts[p][k]), peek_header(sums[p])
        sum_header = {"ok": True, "accepted": sorted(ids), "rejected": [], "exchange": "sums"}  # no clip: no bar
        sum_header |= {"mean_over": "peers", "size": len(sums[p])}
        sum_header = compact_header(sum_header, sorted(ids))  # as the owner serves it: the accepted bitmask
        push = list(stream_messages(runtime_pb2.ExpertRequest, base, [parts[p][k]], chunk_bytes=CHUNK))
        serve = list(stream_messages(runtime_pb2.ExpertResponse, sum_header, [sums[p]], chunk_bytes=CHUNK))
        fetch = header_message(runtime_pb2.ExpertRequest, base).ByteSize()  # the fetch of shard k
        reply = header_message(runtime_pb2.ExpertResponse, {"ok": True, "reason": None}).ByteSize()  # to the push
        sent = _size(iter(push)) + fetch + reply + _size(iter(serve))
        headers = _overhead(iter(push), parts[p][k]) + fetch + reply + _overhead(iter(serve), sums[p])
        whole = encode_sparse(CONTRIBUTION_NAME, NUMEL, *selections[p], round_index=round_index, value_dtype=dtype)
        out.append(
            {
                "bytes_sent": sent,
                "sent_index_bytes": part.index_bytes,
                "sent_value_bytes": part.value_bytes,
                "sent_sum_index_bytes": served.index_bytes,
                "sent_sum_value_bytes": served.value_bytes,
                "sent_header_bytes": headers,
                "num_pushed": part.num_changed,
                "num_sum_entries": served.num_changed,
                "payload_bytes": len(whole),
                "payload_index_bytes": peek_header(whole).index_bytes,
                "payload_value_bytes": peek_header(whole).value_bytes,
            }
        )
    return out


def _selection(seed: int, k: int | None, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    indices = torch.arange(NUMEL) if k is None else torch.randperm(NUMEL, generator=gen)[:k].sort().values
    values = torch.randn(indices.numel(), generator=gen) * 1e-3
    return indices, values.to(torch.bfloat16).float() if dtype == "bfloat16" else values


@pytest.mark.parametrize(
    ("round_index", "k", "dtype"),
    [(0, 120, "float32"), (1, None, "float32"), (2, 200, "bfloat16")],
    ids=["sparse-fp32", "dense-diloco", "sparse-bf16"],
)
def test_two_peers_split_their_bytes_exactly(
    averagers: list[SparseAverager], round_index: int, k: int | None, dtype: str
) -> None:
    selections = [_selection(10 * round_index + p, k, dtype) for p in range(2)]
    results = _all_reduce(averagers, round_index, selections, dtype)
    expected = _expected(averagers, round_index, selections, dtype)
    for result, want in zip(results, expected, strict=True):
        assert result.complete and want["num_pushed"] > 0 and want["num_sum_entries"] > 0
        assert sum(getattr(result, key) for key in SPLIT) == result.bytes_sent
        assert {key: getattr(result, key) for key in want} == want
    assert results[0].bytes_sent == results[1].bytes_received and results[1].bytes_sent == results[0].bytes_received
    if k is None:  # DiLoCo: every entry, no index bytes anywhere
        assert all(r.sent_index_bytes == r.sent_sum_index_bytes == r.payload_index_bytes == 0 for r in results)


def test_a_group_of_one_reuses_its_part_as_payload(averagers: list[SparseAverager]) -> None:
    indices, values = _selection(7, 50, "float32")
    (result,) = _all_reduce(averagers[:1], 3, [(indices, values)], "float32")
    frame = encode_sparse(CONTRIBUTION_NAME, NUMEL, indices, values, round_index=3)
    assert result.bytes_sent == 0 and result.payload_bytes == len(frame)
