"""pulseloco.loco.validation: the outlier screen, and contributions in FP32 and in BF16."""

from __future__ import annotations

import pytest
import torch

from pulseloco.errors import NonFiniteValuesError
from pulseloco.loco.validation import decode_sparse, encode_sparse, screen_outliers


def test_outlier_screen_uses_the_median_of_three_and_the_own_part_below() -> None:
    assert set(screen_outliers({"a": 1.0, "b": 1.2, "c": 50.0}, 10.0)) == {"c"}
    assert screen_outliers({"a": 1.0, "c": 50.0}, 10.0) == {}  # two and no reference: no majority, no verdict
    assert set(screen_outliers({"me": 1.0, "c": 50.0}, 10.0, reference=1.0)) == {"c"}
    assert screen_outliers({"me": 1.0, "c": 5.0}, 10.0, reference=1.0) == {}
    assert screen_outliers({"me": 0.0, "c": 5.0}, 10.0, reference=0.0) == {}  # nothing of its own: no bar


def test_bf16_parts_travel_in_two_bytes_and_decode_to_the_same_fp32_values() -> None:
    gen = torch.Generator().manual_seed(0)
    indices = torch.sort(torch.randperm(100_000, generator=gen)[:2000]).values
    signal = torch.randn(2000, generator=gen) * 1e-4
    values = signal.to(torch.bfloat16).to(torch.float32)
    raw = encode_sparse("pseudo_gradient", 100_000, indices, signal, round_index=3)  # the paper's FP32 signal
    bf16 = encode_sparse("pseudo_gradient", 100_000, indices, values, round_index=3, value_dtype="bfloat16")
    assert len(bf16) < 0.8 * len(raw)
    fp32 = encode_sparse("pseudo_gradient", 100_000, indices, values, round_index=3)
    for payload in (fp32, bf16):
        got_indices, got_values = decode_sparse(payload, "pseudo_gradient", 100_000)
        assert torch.equal(got_indices, indices) and got_values.dtype == torch.float32
        assert torch.equal(got_values.view(torch.int32), values.view(torch.int32))
    nan = torch.full((3,), float("nan"))
    with pytest.raises(NonFiniteValuesError):
        decode_sparse(encode_sparse("x", 10, torch.arange(3), nan, round_index=0, value_dtype="bfloat16"), "x", 10)
    with pytest.raises(ValueError, match="value_dtype"):
        encode_sparse("x", 10, torch.arange(3), torch.zeros(3), round_index=0, value_dtype="float16")
