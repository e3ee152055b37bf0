"""Where PulseLoCo keeps its outer state (``outer_state_device``) and the chunked round: bit-identical to the
whole-tensor round, for every placement, chunk size, selector and parameter dtype."""

from __future__ import annotations

import pytest
import torch
from loco_helpers import flat_params, load_flat, make_model

from pulseloco import PulseLoCo
from pulseloco.errors import ConfigError
from pulseloco.loco import PlacementConfig, RoundConfig
from pulseloco.loco.outer import NesterovOuterOptimizer
from pulseloco.loco.quantize import ParamLayout
from pulseloco.loco.selection import make_selector, select_in_place

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROUNDS = 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _perturb(model: torch.nn.Module, round_index: int) -> None:
    """A deterministic stand-in for the inner steps: noise of magnitudes 1e-6 .. 1e-2, so that the pulse gate
    passes some entries and holds back others."""
    gen = torch.Generator().manual_seed(1000 + round_index)
    with torch.no_grad():
        for p in model.parameters():
            scale = 10.0 ** torch.empty(p.shape).uniform_(-6, -2, generator=gen)
            p.add_((torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype))


def _model(dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    return make_model(0).to(device=device, dtype=dtype)


def _reference(selector: str, dtype: torch.dtype, **selector_kwargs: object) -> dict[str, torch.Tensor]:
    """The whole-tensor round PulseLoCo ran before the chunked one (one peer, no swarm)."""
    model = _model(dtype)
    theta = flat_params(model).clone()
    residual = torch.zeros_like(theta)
    rounds = RoundConfig(inner_steps=1, selector=selector, **selector_kwargs)  # type: ignore[arg-type]
    outer = rounds.make_outer_optimizer()
    rule = rounds.make_selector(ParamLayout([tuple(p.shape) for p in model.parameters()]))
    decay = rounds.resolved("error_decay")
    for r in range(ROUNDS):
        _perturb(model, r)
        pseudo_gradient = theta - flat_params(model)
        signal = (residual * decay if decay != 1.0 else residual) + pseudo_gradient
        selection = rule.select(theta, signal)
        residual = selection.residual_N
        average = torch.zeros_like(theta)
        average[selection.indices_K] = selection.values_K
        outer.step(theta, average)
        load_flat(model, theta)
    assert outer.momentum_N is not None
    return {"theta": theta, "residual": residual, "momentum": outer.momentum_N, "model": flat_params(model)}


def _pulseloco(
    selector: str,
    dtype: torch.dtype,
    *,
    device: str = "cpu",
    placement: PlacementConfig | None = None,
    **kwargs: object,
) -> dict[str, torch.Tensor]:
    model = _model(dtype, device)
    rounds = RoundConfig(inner_steps=1, selector=selector, **kwargs)  # type: ignore[arg-type]
    opt = PulseLoCo(model, None, round_config=rounds, placement_config=placement)
    for r in range(ROUNDS):
        _perturb(model, r)
        opt.count_inner_step()
    momentum = opt.outer_optimizer.momentum_N
    assert momentum is not None
    assert opt.theta_N.device == momentum.device == opt.residual_N.device == opt.placement.device
    return {"theta": opt.theta_N, "residual": opt.residual_N, "momentum": momentum, "model": flat_params(model)}


CASES = [
    ("pulse", {}),
    ("pulse", {"pulse_values": "bfloat16"}),
    ("dense", {}),
    ("sparseloco", {"topk_k": 8, "chunk_size": 8}),
    ("pulse", {"pulse_values": "quantized", "pulse_budget": 8, "chunk_size": 8}),
]
IDS = ["pulse", "pulse-bf16", "dense", "sparseloco", "pulse-2bit-k8"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("selector", "selector_kwargs"), CASES, ids=IDS)
def test_chunked_round_is_bit_identical_to_the_whole_tensor_round(
    selector: str, selector_kwargs: dict[str, object], dtype: torch.dtype
) -> None:
    expected = _reference(selector, dtype, **selector_kwargs)
    # 1000-byte chunks split parameters across chunks (and chunks across parameters); 1 GiB is one chunk.
    for chunk_bytes, placement in ((1000, "cpu"), (1000, "model"), (2**30, "auto")):
        placed = PlacementConfig(outer_state_device=placement, outer_chunk_bytes=chunk_bytes)  # type: ignore[arg-type]
        got = _pulseloco(selector, dtype, placement=placed, **selector_kwargs)
        for name, tensor in expected.items():
            assert _bits_equal(got[name], tensor), (name, placement, chunk_bytes)


def test_outer_state_is_plain_host_memory_for_a_cpu_model() -> None:
    opt = PulseLoCo(_model(torch.float32), None, placement_config=PlacementConfig(outer_state_device="model"))
    assert opt.placement.device == torch.device("cpu") and not opt.placement.pin_memory and not opt.theta_N.is_pinned()
    assert _bits_equal(opt.theta_N, flat_params(opt.model))


@pytest.mark.parametrize(("selector", "selector_kwargs"), CASES, ids=IDS)
def test_select_in_place_matches_select(selector: str, selector_kwargs: dict[str, object]) -> None:
    gen = torch.Generator().manual_seed(7)
    theta = torch.randn(5000, generator=gen)
    signal = torch.randn(5000, generator=gen) * 10.0 ** torch.empty(5000).uniform_(-7, -1, generator=gen)
    signal[::97] = -0.0
    theta[::89] = -0.0
    rule = make_selector(selector, layout=ParamLayout([(50, 100)]), **selector_kwargs)  # type: ignore[arg-type]
    expected = rule.select(theta, signal)
    for chunk_numel in (1, 255, 256, 1000, 10**6):
        buffer = signal.clone()
        indices, values, value_dtype = select_in_place(rule, theta, buffer, chunk_numel=chunk_numel)
        assert torch.equal(indices, expected.indices_K), chunk_numel
        assert _bits_equal(values, expected.values_K), chunk_numel
        assert _bits_equal(buffer, expected.residual_N), chunk_numel
        assert value_dtype == expected.value_dtype


def test_step_sparse_matches_step() -> None:
    gen = torch.Generator().manual_seed(3)
    theta = torch.randn(3000, generator=gen)
    dense, sparse = NesterovOuterOptimizer(0.7, 0.9), NesterovOuterOptimizer(0.7, 0.9)
    theta_dense, theta_sparse = theta.clone(), theta.clone()
    sparse.momentum_N = torch.zeros(3000)
    for _ in range(3):
        indices = torch.randperm(3000, generator=gen)[:700]  # unsorted: step_sparse sorts them
        values = torch.randn(700, generator=gen) * 1e-3
        gradient = torch.zeros(3000)
        gradient[indices] = values
        dense.step(theta_dense, gradient)
        sparse.step_sparse(theta_sparse, indices, values, chunk_numel=512)
    assert dense.momentum_N is not None and sparse.momentum_N is not None
    assert _bits_equal(theta_dense, theta_sparse) and _bits_equal(dense.momentum_N, sparse.momentum_N)
    with pytest.raises(IndexError):
        sparse.step_sparse(theta_sparse, torch.tensor([3000]), torch.tensor([1.0]), chunk_numel=512)
    with pytest.raises(ValueError, match="momentum buffer"):
        NesterovOuterOptimizer().step_sparse(theta, indices, values, chunk_numel=512)


def test_overflowing_pseudo_gradient_drops_the_round_like_a_non_finite_one() -> None:
    """Local parameters above 2**103 go through the exact chunked check: ``theta - local`` may overflow."""
    model = _model(torch.float32)
    first = next(model.parameters())
    with torch.no_grad():
        first.view(-1)[5] = -3e38
    opt = PulseLoCo(
        model, None, round_config=RoundConfig(inner_steps=1), placement_config=PlacementConfig(outer_chunk_bytes=4096)
    )
    theta_before = opt.theta_N.clone()
    with torch.no_grad():
        first.view(-1)[5] = 2.0**110  # finite, large, and theta - local stays finite
    assert opt._pseudo_gradient_is_finite(opt.theta_N)
    with torch.no_grad():
        first.view(-1)[5] = 3e38  # -3e38 - 3e38 overflows
    assert not opt._pseudo_gradient_is_finite(opt.theta_N)
    opt.count_inner_step()
    assert _bits_equal(opt.theta_N, theta_before)  # a zero pseudo-gradient moves nothing
    assert not opt.residual_N.any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"outer_state_device": "gpu"}, "outer_state_device must be one of auto, cpu, model"),
        ({"outer_state_device": "cuda:0"}, "outer_state_device must be one of"),
        ({"outer_chunk_bytes": 0}, "outer_chunk_bytes must be an integer of at least 4 bytes"),
        ({"outer_chunk_bytes": 1.5}, "outer_chunk_bytes must be an integer"),
        ({"outer_chunk_bytes": True}, "outer_chunk_bytes must be an integer"),
    ],
)
def test_bad_placement_options_raise_config_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PulseLoCo(_model(torch.float32), None, placement_config=PlacementConfig(**kwargs))  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: pinned host state vs GPU state")
@pytest.mark.parametrize(("selector", "selector_kwargs"), CASES, ids=IDS)
def test_cuda_model_with_pinned_host_state_matches_gpu_state_and_the_cpu_path(
    selector: str, selector_kwargs: dict[str, object]
) -> None:
    expected = _pulseloco(selector, torch.bfloat16, device="cpu", **selector_kwargs)
    for placement in ("auto", "cpu", "model"):
        model = _model(torch.bfloat16, "cuda")
        opt = PulseLoCo(
            model,
            None,
            round_config=RoundConfig(inner_steps=1, selector=selector, **selector_kwargs),  # type: ignore[arg-type]
            placement_config=PlacementConfig(outer_state_device=placement, outer_chunk_bytes=4096),  # type: ignore[arg-type]
        )
        assert opt.theta_N.is_cuda == (placement == "model")
        assert opt.theta_N.is_pinned() == (placement != "model")
        for r in range(ROUNDS):
            _perturb(model, r)
            opt.count_inner_step()
        torch.cuda.synchronize()
        momentum = opt.outer_optimizer.momentum_N
        assert momentum is not None
        got = {"theta": opt.theta_N, "residual": opt.residual_N, "momentum": momentum, "model": flat_params(model)}
        for name, tensor in expected.items():
            assert _bits_equal(got[name], tensor), (name, placement)
