"""Selection rules: the compute-visibility gate on crafted values, conservation, dense and top-k."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pulseloco.errors import ConfigError
from pulseloco.loco.quantize import ParamLayout, quantize_lut, tile_topk_mask
from pulseloco.loco.selection import (
    ChunkedSelector,
    DenseSelector,
    PulseSelector,
    compute_visible_mask,
    make_selector,
)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_gate_worked_example_from_design() -> None:
    """theta = 2.0: s = 0.003 stays in the residual; adding 0.002 makes s = 0.005, which fires."""
    theta = torch.tensor([2.0], dtype=torch.float32)
    selector = PulseSelector()
    signal = torch.tensor([0.003], dtype=torch.float32)
    first = selector.select(theta, signal)
    assert first.num_sent == 0
    assert _bits_equal(first.residual_N, signal)
    second_signal = first.residual_N + torch.tensor([0.002], dtype=torch.float32)
    second = selector.select(theta, second_signal)
    assert second.indices_K.tolist() == [0]
    assert _bits_equal(second.values_K, second_signal)  # the raw FP32 signal, not the BF16-rounded change
    assert second.residual_N.item() == 0.0


def test_gate_threshold_is_the_bf16_rounding_midpoint() -> None:
    """Below 2.0 the BF16 neighbour is 1.9921875; theta - s rounds down past the midpoint 1.99609375."""
    theta = torch.full((4,), 2.0)
    signal = torch.tensor([0.0039, 0.0040, -0.0078, -0.0079])  # above 2.0 the spacing is twice as large
    mask = compute_visible_mask(theta, signal)
    assert mask.tolist() == [False, True, False, True]


def test_gate_is_bitwise() -> None:
    """+0.0 -> -0.0 changes the BF16 bit pattern, so the gate fires although the floats compare equal."""
    theta = torch.tensor([0.0, 1.0])
    signal = torch.tensor([0.0, 0.0])
    assert compute_visible_mask(theta, signal).tolist() == [False, False]
    assert compute_visible_mask(torch.tensor([0.0]), torch.tensor([1e-30])).tolist() == [True]


SELECTOR_CASES: dict[str, dict[str, Any]] = {
    "pulse": {},
    "pulse-bf16": {"pulse_values": "bfloat16"},
    "dense": {},
    "sparseloco": {"topk_k": 64},
    "pulse-2bit": {"pulse_values": "quantized"},
    "pulse-2bit-k64": {"pulse_values": "quantized", "pulse_budget": 64},
}
LAYOUT = ParamLayout([(40, 130), (70,), (64, 64)])


@pytest.mark.parametrize("case", list(SELECTOR_CASES))
def test_conservation_sent_plus_residual_equals_signal(case: str) -> None:
    """sent + residual == signal: bit for bit for FP32 and BF16 values; for quantized values the residual is the
    quantization error rounded once to FP32, so the sum is the signal within half an ulp of the residual."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(LAYOUT.numel, generator=gen) * 0.02
    signal = torch.randn(LAYOUT.numel, generator=gen) * 1e-4
    name = case.split("-")[0]
    selection = make_selector(name, layout=LAYOUT, **SELECTOR_CASES[case]).select(theta, signal)
    assert torch.all(selection.indices_K[1:] > selection.indices_K[:-1])
    sent = torch.zeros_like(signal)
    sent[selection.indices_K] = selection.values_K
    if selection.value_dtype == "quantized":
        error = (sent.double() + selection.residual_N.double()) - signal.double()
        half_ulp = torch.finfo(torch.float32).eps * selection.residual_N.double().abs() / 2
        assert torch.all(error.abs() <= half_ulp)
        assert 0 < selection.num_sent < signal.numel()
    else:
        assert _bits_equal(sent + selection.residual_N, signal)
    if selection.value_dtype == "float32":
        assert torch.all(selection.residual_N[selection.indices_K] == 0)
    if name == "pulse":
        assert 0 < selection.num_sent < signal.numel()


def test_pulse_error_feedback_accumulates_until_visible() -> None:
    """A constant sub-threshold update fires after enough rounds, and the total sent equals the total signal."""
    theta = torch.full((1,), 0.5)
    selector = PulseSelector()
    residual = torch.zeros(1)
    update = torch.full((1,), 1e-4)
    sent_total = torch.zeros(1, dtype=torch.float64)
    fired_at = []
    for step in range(40):
        signal = residual + update
        selection = selector.select(theta, signal)
        if selection.num_sent:
            fired_at.append(step)
            sent_total += selection.values_K.double()
        residual = selection.residual_N
    assert fired_at and fired_at[0] > 0
    assert (sent_total + residual.double()).item() == pytest.approx(40e-4, rel=1e-5)


def test_dense_sends_everything_with_zero_residual() -> None:
    theta = torch.randn(100)
    signal = torch.randn(100)
    selection = DenseSelector().select(theta, signal)
    assert selection.indices_K.tolist() == list(range(100))
    assert _bits_equal(selection.values_K, signal)
    assert not selection.residual_N.any()


def test_tile_topk_keeps_the_largest_per_tile_scaled_at_the_edges() -> None:
    """A 3 x 5 matrix in 2 x 2 tiles at k = 2 (of 4): full tiles keep 2, a 2-entry edge tile 1, a 1-entry one 1."""
    magnitude = torch.tensor(
        [[1.0, 9.0, 2.0, 8.0, 5.0], [7.0, 3.0, 6.0, 4.0, 0.5], [0.1, 0.2, 0.3, 0.4, 0.6]], dtype=torch.float32
    )
    keep = tile_topk_mask(magnitude, k=2, chunk=2)
    assert keep.nonzero().tolist() == [[0, 1], [0, 3], [0, 4], [1, 0], [1, 2], [2, 1], [2, 3], [2, 4]]


def test_tile_topk_breaks_ties_by_the_earlier_entry() -> None:
    keep = tile_topk_mask(torch.tensor([[2.0, 2.0, 1.0, 2.0]]), k=2, chunk=4)  # one row: ceil(2 * 4 / 16) = 1 kept
    assert keep.nonzero().tolist() == [[0, 0]]


def test_sparseloco_keeps_k_per_full_tile_and_one_per_row_of_a_vector() -> None:
    layout = ParamLayout([(128, 192), (4096,)])
    signal = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1))
    selection = make_selector("sparseloco", layout=layout, topk_k=64).select(torch.zeros_like(signal), signal)
    assert selection.num_sent == 6 * 64 + 4096 // 64  # six 64 x 64 tiles, then one entry per row of 64
    matrix = signal[: 128 * 192].abs().view(2, 64, 3, 64).permute(0, 2, 1, 3).reshape(6, 4096)
    threshold = matrix.topk(64, dim=1).values[:, -1]
    kept = torch.zeros(layout.numel, dtype=torch.bool)
    kept[selection.indices_K] = True
    kept_tiles = kept[: 128 * 192].view(2, 64, 3, 64).permute(0, 2, 1, 3).reshape(6, 4096)
    assert torch.all(kept_tiles.sum(dim=1) == 64)
    assert torch.all(torch.where(kept_tiles, matrix, torch.inf).min(dim=1).values >= threshold)
    for start, stop in ((0, 128 * 192), (128 * 192, layout.numel)):  # 2 bits: at most 4 values per parameter
        inside = (selection.indices_K >= start) & (selection.indices_K < stop)
        assert selection.values_K[inside].unique().numel() <= 4


def test_pulse_budget_sends_only_visible_entries_at_most_k_per_tile() -> None:
    layout = ParamLayout([(64, 64)])
    gen = torch.Generator().manual_seed(2)
    theta = torch.randn(layout.numel, generator=gen) * 0.02
    signal = torch.randn(layout.numel, generator=gen) * 1e-4
    visible = compute_visible_mask(theta, signal)
    budget = make_selector("pulse", layout=layout, pulse_values="float32", pulse_budget=16).select(theta, signal)
    assert isinstance(make_selector("pulse", layout=layout, pulse_budget=16), ChunkedSelector)
    assert budget.num_sent == min(16, int(visible.sum()))
    assert torch.all(visible[budget.indices_K])
    largest_visible = signal.abs()[visible].topk(16).values
    assert torch.equal(budget.values_K.abs().sort(descending=True).values, largest_visible)


def test_quantizer_decodes_each_bin_to_its_mean_hand_checked() -> None:
    """[6, 8, 11, 13, 12]: mean 10, centred [-4, -2, 1, 3, 2], std sqrt(34 / 4), scale 6 std / 4 = 4.373; codes
    round(c / scale + 2) = [1, 2, 2, 3, 2]; bin means -4, 1/3, 3; decoded [6, 10 1/3, 10 1/3, 13, 10 1/3]."""
    decoded = quantize_lut(torch.tensor([6.0, 8.0, 11.0, 13.0, 12.0]), bits=2)
    third = torch.tensor(1.0, dtype=torch.float32) / 3 + 10.0
    assert decoded[[0, 3]].tolist() == [6.0, 13.0]
    assert _bits_equal(decoded[[1, 2, 4]], third.expand(3))
    assert quantize_lut(torch.full((3,), 0.25)).tolist() == [0.25, 0.25, 0.25]  # one value: the mean, exactly
    assert quantize_lut(torch.zeros(0)).numel() == 0


def test_bad_configuration_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="selector"):
        make_selector("random")
    with pytest.raises(ConfigError, match="topk_k"):
        make_selector("sparseloco", topk_k=0)
    with pytest.raises(ConfigError, match="quant_bits"):
        make_selector("sparseloco", quant_bits=9)
    with pytest.raises(ConfigError, match="need selector 'pulse'"):
        make_selector("sparseloco", pulse_budget=4)
    with pytest.raises(TypeError):
        PulseSelector().select(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))


def test_bf16_values_keep_the_rounding_remainder_and_conserve_exactly() -> None:
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(10_000, generator=gen) * 0.02
    signal = torch.randn(10_000, generator=gen) * 1e-4
    fp32 = PulseSelector().select(theta, signal)
    bf16 = make_selector("pulse", pulse_values="bfloat16").select(theta, signal)
    assert bf16.value_dtype == "bfloat16" and torch.equal(bf16.indices_K, fp32.indices_K)  # the same gate
    assert _bits_equal(bf16.values_K.to(torch.bfloat16).to(torch.float32), bf16.values_K)  # exact in BF16
    sent = torch.zeros_like(signal)
    sent[bf16.indices_K] = bf16.values_K
    assert _bits_equal(sent + bf16.residual_N, signal)  # sent as decoded + residual == signal, bit for bit
    remainder = bf16.residual_N[bf16.indices_K]
    assert remainder.any() and torch.all(remainder.abs() <= bf16.values_K.abs() * 2.0**-8)
    unsent = torch.ones(signal.numel(), dtype=torch.bool)
    unsent[bf16.indices_K] = False
    assert _bits_equal(bf16.residual_N[unsent], signal[unsent])


def test_bf16_values_only_for_the_pulse_rule() -> None:
    with pytest.raises(ConfigError, match="pulse_values must be one of"):
        make_selector("pulse", pulse_values="float16")
    with pytest.raises(ConfigError, match="need selector 'pulse'"):
        make_selector("dense", pulse_values="bfloat16")
