"""Selection rules: the compute-visibility gate on crafted values, conservation, dense and top-k."""

from __future__ import annotations

import pytest
import torch

from pulseloco.errors import ConfigError
from pulseloco.loco.selection import (
    DenseSelector,
    PulseSelector,
    TopKSelector,
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


@pytest.mark.parametrize("name", ["pulse", "dense", "topk"])
def test_conservation_sent_plus_residual_equals_signal_exactly(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(10_000, generator=gen) * 0.02
    signal = torch.randn(10_000, generator=gen) * 1e-4
    selection = make_selector(name, topk_density=0.05, topk_chunk_size=256).select(theta, signal)
    assert torch.all(selection.indices_K[1:] > selection.indices_K[:-1])
    sent = torch.zeros_like(signal)
    sent[selection.indices_K] = selection.values_K
    assert _bits_equal(sent + selection.residual_N, signal)
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


def test_topk_keeps_the_largest_per_chunk() -> None:
    signal = torch.tensor([0.1, -5.0, 0.2, 0.3, 9.0, -0.1, 0.0, 7.0, 0.5, -0.4], dtype=torch.float32)
    selection = TopKSelector(density=0.25, chunk_size=4).select(torch.zeros(10), signal)
    # chunks [0:4] -> -5.0; [4:8] -> 9.0; the last chunk [8:10] keeps k=1 of its two entries -> 0.5
    assert selection.indices_K.tolist() == [1, 4, 8]
    assert selection.values_K.tolist() == [-5.0, 9.0, 0.5]


def test_topk_breaks_ties_by_lowest_index() -> None:
    # BF16 signals tie often; torch.topk breaks ties differently on CPU and CUDA, the selector must not
    signal = torch.tensor([1.0, -2.0, 2.0, 2.0, -2.0, 0.5, 2.0, 2.0, 1.0, 1.0, 1.0], dtype=torch.float32)
    selection = TopKSelector(density=0.5, chunk_size=8).select(torch.zeros(11), signal)
    # chunk [0:8] keeps 4 of its five 2.0s (the first four); the last chunk [8:11] keeps all three
    assert selection.indices_K.tolist() == [1, 2, 3, 4, 8, 9, 10]
    reversed_ = TopKSelector(density=0.5, chunk_size=8).select(torch.zeros(8), signal[:8].flip(0))
    assert reversed_.indices_K.tolist() == [0, 1, 3, 4]  # flipped: the 2.0s sit at 0, 1, 3, 4, 5, 6


def test_topk_density() -> None:
    signal = torch.randn(4096 * 8, generator=torch.Generator().manual_seed(1))
    selection = TopKSelector(density=0.01, chunk_size=4096).select(torch.zeros_like(signal), signal)
    assert selection.num_sent == 8 * 41  # ceil(0.01 * 4096) per chunk
    threshold = signal.abs().view(8, 4096).topk(41, dim=1).values[:, -1]
    assert torch.all(selection.values_K.abs().view(8, 41) >= threshold[:, None])


def test_bad_configuration_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="selector"):
        make_selector("random")
    with pytest.raises(ConfigError, match="topk_density"):
        TopKSelector(density=0.0)
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
    with pytest.raises(ConfigError, match="needs selector 'pulse'"):
        make_selector("dense", pulse_values="bfloat16")
