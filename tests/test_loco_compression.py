"""SparseLoCo's wire: quantized values in the codec's lut mode (packed codes and tables, bit for bit), the
aggregation rules (mean over peers, mean over senders) on hand-checked parts, and the byte layout of gathered
parts."""

from __future__ import annotations

import pytest
import torch
from codec_helpers import Frame

from pulseloco.codec import decode_payload, encode_payload, peek_header
from pulseloco.codec.frame import SparseTensor
from pulseloco.codec.lut import decode_lut, encode_lut, lut_value_bytes
from pulseloco.errors import NonFiniteValuesError, PayloadError, PayloadSizeError, TensorMismatchError
from pulseloco.loco.quantize import ParamLayout, quantize_lut
from pulseloco.loco.selection import make_selector
from pulseloco.loco.shard_owner import combine_parts
from pulseloco.loco.traffic import FrameLayout
from pulseloco.loco.validation import decode_sparse, encode_sparse, lut_groups


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_lut_packs_four_two_bit_codes_a_byte_hand_checked() -> None:
    """Two groups: [1, 2, 1, 3, 4] (four distinct values: 2 bits) and [-0.5]; tables sorted by bit pattern."""
    values = torch.tensor([1.0, 2.0, 1.0, 3.0, 4.0, -0.5])
    raw, bits = encode_lut(values, (5, 1))
    assert bits == 2 and len(raw) == lut_value_bytes(6, 2, 2) == 2 * 16 + 2
    table = torch.frombuffer(bytearray(raw[:32]), dtype=torch.float32)
    assert table.tolist() == [1.0, 2.0, 3.0, 4.0, -0.5, -0.5, -0.5, -0.5]  # a short table repeats its last value
    # codes 0 1 0 2 | 3 0: LSB first, 0b10_00_01_00 = 0x84, then 0b00_00_00_11 = 0x03
    assert raw[32:] == bytes([0x84, 0x03])
    assert _bits(decode_lut(raw, 6, (5, 1), bits)).equal(_bits(values))


def test_quantized_parts_decode_bit_for_bit_through_the_frame() -> None:
    layout = ParamLayout([(96, 80), (300,), (64, 64)])
    gen = torch.Generator().manual_seed(3)
    selection = make_selector("sparseloco", layout=layout).select(
        torch.zeros(layout.numel), torch.randn(layout.numel, generator=gen) * 1e-3
    )
    frame = encode_sparse(
        "pseudo_gradient",
        layout.numel,
        selection.indices_K,
        selection.values_K,
        round_index=4,
        value_dtype="quantized",
        group_starts=layout.group_starts(),
    )
    indices, values = decode_sparse(frame, "pseudo_gradient", layout.numel)
    assert torch.equal(indices, selection.indices_K) and _bits(values).equal(_bits(selection.values_K))
    header = peek_header(frame)
    assert header.value_mode == "lut" and header.tensors[0]["bits"] <= 2  # the tables hold what the bins hold
    assert len(header.tensors[0]["groups"]) == 3  # one table per parameter
    # A shard that starts inside the first parameter: its local group starts are shifted, values still exact.
    start = 5000
    inside = selection.indices_K >= start
    part = encode_sparse(
        "pseudo_gradient",
        layout.numel - start,
        selection.indices_K[inside] - start,
        selection.values_K[inside],
        round_index=4,
        value_dtype="quantized",
        group_starts=layout.group_starts() - start,
    )
    _, part_values = decode_sparse(part, "pseudo_gradient", layout.numel - start)
    assert _bits(part_values).equal(_bits(selection.values_K[inside]))


def test_lut_groups_cut_sorted_indices_at_the_group_starts() -> None:
    indices = torch.tensor([0, 3, 9, 10, 11, 25])
    assert lut_groups(indices, torch.tensor([0, 10, 20, 30])) == (3, 2, 1)
    assert lut_groups(indices, torch.tensor([-5, 4])) == (2, 4)  # entries before the second start: group one
    assert lut_groups(indices[:0], torch.tensor([0])) == ()


def test_lut_refuses_unquantized_values_and_malformed_bytes() -> None:
    with pytest.raises(ValueError, match="distinct values"):
        encode_lut(torch.arange(300, dtype=torch.float32), (300,))
    raw, bits = encode_lut(torch.tensor([1.0, 2.0, 3.0]), (3,))
    with pytest.raises(PayloadSizeError):
        decode_lut(raw[:-1], 3, (3,), bits)
    with pytest.raises(PayloadError, match="groups add up"):
        decode_lut(raw, 3, (2,), bits)
    with pytest.raises(PayloadError, match="padding"):
        decode_lut(raw[:-1] + bytes([raw[-1] | 0x80]), 3, (3,), bits)
    nan_table = torch.tensor([float("nan")] + [1.0] * 3).numpy().tobytes() + raw[16:]
    with pytest.raises(NonFiniteValuesError):
        decode_lut(nan_table, 3, (3,), bits)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("groups", [2, 2], "add up"), ("groups", [0, 3], "positive"), ("bits", 3, "bits"), ("groups", None, "groups")],
)
def test_frame_header_of_a_lut_tensor_is_checked(field: str, value: object, message: str) -> None:
    frame = encode_payload(
        [SparseTensor("x", (8,), torch.float32, torch.tensor([1, 2, 5]), torch.tensor([0.5, 0.25, 0.5]), groups=(3,))],
        value_mode="lut",
        version=0,
        base_version=None,
    )
    parsed = Frame.parse(frame)
    parsed.tensors[0][field] = value
    with pytest.raises(PayloadError, match=message):
        decode_payload(parsed.assemble())


def test_a_lut_frame_is_refused_where_another_tensor_is_expected() -> None:
    frame = encode_sparse("other", 8, torch.tensor([1]), torch.tensor([0.5]), round_index=0, value_dtype="quantized")
    with pytest.raises(TensorMismatchError):
        decode_sparse(frame, "pseudo_gradient", 8)


def test_mean_over_senders_and_over_peers_of_three_parts_hand_checked() -> None:
    """Three peers' parts of a 6-entry shard: a = {0: 3, 2: 6}, b = {2: 3, 4: 1}, c = {2: 3, 4: -4, 5: 9} at clip
    scales 1, 1 and 0.5 (c counts at half). Over senders: entry 2 = (6 + 3 + 1.5) / 3 = 3.5, entry 4 = (1 - 2) / 2
    = -0.5, entries 0 and 5 sent by one peer each keep their value (3 and 4.5). Over peers: every sum / 3."""
    a = (torch.tensor([0, 2]), torch.tensor([3.0, 6.0]))
    b = (torch.tensor([2, 4]), torch.tensor([3.0, 1.0]))
    c = (torch.tensor([2, 4, 5]), torch.tensor([3.0, -4.0, 9.0]))
    parts = [(a, 1.0), (b, 1.0), (c, 0.5)]
    indices, senders = combine_parts(parts, 6, "senders")
    assert indices.tolist() == [0, 2, 4, 5]
    assert senders.tolist() == [3.0, 3.5, -0.5, 4.5]
    _, sums = combine_parts(parts, 6, "peers")
    assert sums.tolist() == [3.0, 10.5, -1.0, 4.5]  # the members divide these by the 3 peers counted


def test_gathered_frames_split_into_their_index_and_value_sections() -> None:
    frames = [
        encode_sparse(
            "p", 100, torch.tensor([3, 50]), torch.tensor([1.0, -1.0]), round_index=0, value_dtype="quantized"
        ),
        encode_sparse("p", 100, torch.tensor([7]), torch.tensor([2.0]), round_index=0),
    ]
    layout = FrameLayout.of_frames(frames)
    headers = [peek_header(frame) for frame in frames]
    assert layout.num_entries == 3
    index, value = layout.split(0, sum(map(len, frames)))
    assert index == sum(h.index_bytes for h in headers) and value == sum(h.value_bytes for h in headers)
    # a byte range inside the second frame's value section counts only there
    second_value = len(frames[0]) + headers[1].header_bytes + headers[1].index_bytes
    assert layout.split(second_value, second_value + 2) == (0, 2)


def test_quantizer_values_stay_within_their_groups_table() -> None:
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(5))
    decoded = quantize_lut(values, bits=2)
    assert decoded.unique().numel() <= 4
    assert float((decoded - values).abs().mean()) < float(values.abs().mean())  # a quantizer, not noise
