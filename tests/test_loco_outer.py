"""The outer optimizer and PulseLoCo on one peer (no swarm): exact agreement with a plain DiLoCo reference,
resume from ``state_dict``, metrics lines, configuration errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from loco_helpers import batch, flat_params, inner_step, load_flat, make_inner_optimizer, make_model

from pulseloco import PulseLoCo
from pulseloco.errors import ConfigError, TensorMismatchError
from pulseloco.jsonl import read_json_lines
from pulseloco.loco import AveragingConfig, RoundConfig
from pulseloco.loco.outer import NesterovOuterOptimizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

H = 3


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_nesterov_matches_the_formula_and_torch_sgd() -> None:
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(1000, generator=gen)
    outer = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
    ref_theta, ref_v = theta.clone(), torch.zeros(1000)
    sgd_param = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([sgd_param], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        g = torch.randn(1000, generator=gen) * 1e-3
        outer.step(theta, g)
        ref_v = 0.9 * ref_v + g
        ref_theta = ref_theta - 0.7 * (g + 0.9 * ref_v)
        sgd_param.grad = g.clone()
        sgd.step()
    assert _bits_equal(theta, ref_theta)
    assert torch.allclose(theta, sgd_param.detach(), rtol=0, atol=1e-6)


def _diloco_reference(num_rounds: int, inner_lr: float) -> torch.Tensor:
    """Plain single-peer DiLoCo: H AdamW steps, pseudo-gradient, Nesterov outer step, reset."""
    model = make_model(0)
    inner = make_inner_optimizer(model, inner_lr)
    theta = flat_params(model).clone()
    v = torch.zeros_like(theta)
    for r in range(num_rounds):
        for i in range(H):
            inner_step(model, inner, batch(0, r * H + i))
            inner.step()
            inner.zero_grad()
        g = theta - flat_params(model)
        v = 0.9 * v + g
        theta = theta - 0.7 * (g + 0.9 * v)
        load_flat(model, theta)
    return theta


def _train(opt: PulseLoCo, model: torch.nn.Module, inner: torch.optim.Optimizer, num_rounds: int) -> list[str]:
    digests = []
    target = opt.round + num_rounds
    while opt.round < target:
        loss = inner_step(model, inner, batch(0, opt.round * H + opt.local_step))
        opt.step(loss=loss)
        opt.zero_grad()
        if opt.local_step == 0:
            assert opt.last_metrics is not None
            digests.append(opt.last_metrics.theta_digest)
    return digests


def test_dense_selector_reproduces_diloco_exactly() -> None:
    reference = _diloco_reference(num_rounds=4, inner_lr=1e-3)
    model = make_model(0)
    inner = make_inner_optimizer(model, 1e-3)
    opt = PulseLoCo(
        model, inner, round_config=RoundConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9, selector="dense")
    )
    _train(opt, model, inner, 4)
    assert _bits_equal(opt.theta_N, reference)
    assert _bits_equal(flat_params(model), reference)
    assert not opt.residual_N.any()


@pytest.mark.parametrize("selector", ["pulse", "sparseloco"])
def test_resume_from_state_dict_continues_the_same_trajectory(selector: str, tmp_path: Path) -> None:
    model = make_model(0)
    inner = make_inner_optimizer(model, 1e-4)
    opt = PulseLoCo(
        model, inner, round_config=RoundConfig(inner_steps=H, selector=selector), metrics_path=tmp_path / "m.jsonl"
    )
    straight = _train(opt, model, inner, 4)

    model = make_model(0)
    inner = make_inner_optimizer(model, 1e-4)
    opt = PulseLoCo(model, inner, round_config=RoundConfig(inner_steps=H, selector=selector))
    first = _train(opt, model, inner, 2)
    torch.save(opt.state_dict(), tmp_path / "state.pt")

    model = make_model(seed=123)  # a different init: everything must come from the state
    inner = make_inner_optimizer(model, 1e-4)
    opt = PulseLoCo(model, inner, round_config=RoundConfig(inner_steps=H, selector=selector))
    opt.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    assert opt.round == 2
    assert opt.residual_N.any()  # error feedback carried over
    second = _train(opt, model, inner, 2)
    assert first + second == straight


def test_metrics_lines(tmp_path: Path) -> None:
    model = make_model(0)
    inner = make_inner_optimizer(model, 1e-4)
    path = tmp_path / "metrics" / "loco.jsonl"
    opt = PulseLoCo(model, inner, round_config=RoundConfig(inner_steps=H, selector="pulse"), metrics_path=path)
    _train(opt, model, inner, 2)
    lines = read_json_lines(path)
    assert [line["round"] for line in lines] == [0, 1]
    required = {
        "round",
        "num_peers",
        "num_sent",
        "density",
        "bytes_sent",
        "bytes_received",
        "seconds_inner",
        "seconds_sync",
        "loss",
        "theta_digest",
    }
    assert required <= lines[0].keys()
    assert lines[0]["num_peers"] == 1 and 0 < lines[0]["density"] < 1
    assert lines[0]["num_sent"] == round(lines[0]["density"] * opt.numel)
    assert isinstance(lines[0]["loss"], float)


def test_load_state_dict_rejects_mismatched_state() -> None:
    model = make_model(0)
    opt = PulseLoCo(model, make_inner_optimizer(model, 1e-4), round_config=RoundConfig(inner_steps=H))
    state = opt.state_dict()
    before = opt.theta_N.clone()
    bad = dict(state, theta_N=torch.zeros(5))
    with pytest.raises(TensorMismatchError):
        opt.load_state_dict(bad)
    with pytest.raises(ConfigError, match="residual_N"):
        opt.load_state_dict({k: v for k, v in state.items() if k != "residual_N"})
    assert _bits_equal(opt.theta_N, before)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"round_config": lambda: RoundConfig(inner_steps=0)}, "inner_steps"),
        ({"round_config": lambda: RoundConfig(selector="random")}, "selector"),  # type: ignore[arg-type]
        ({"round_config": lambda: RoundConfig(outer_lr=0.0)}, "outer_lr"),
        ({"round_config": lambda: RoundConfig(outer_lr=float("inf"))}, "outer_lr"),
        ({"round_config": lambda: RoundConfig(outer_momentum=1.0)}, "outer_momentum"),
        ({"round_config": lambda: RoundConfig(topk_k=0, selector="sparseloco")}, "topk_k"),
        ({"round_config": lambda: RoundConfig(error_decay=1.5)}, "error_decay"),
        ({"round_config": lambda: RoundConfig(mean_over="all")}, "mean_over"),
        ({"averaging_config": lambda: AveragingConfig(exchange="broadcast")}, "exchange"),
        ({"round_config": lambda: RoundConfig(pulse_values="bfloat16", selector="dense")}, "pulse_values"),
        ({"averaging_config": lambda: AveragingConfig(averaging_timeout=0)}, "averaging_timeout"),
        ({"averaging_config": lambda: AveragingConfig(digest_timeout=float("nan"))}, "digest_timeout"),
        ({"averaging_config": lambda: AveragingConfig(max_norm_ratio=1.0)}, "max_norm_ratio"),
        ({"averaging_config": lambda: AveragingConfig(ledger_rounds=0)}, "ledger_rounds must be an integer from 1"),
        ({"averaging_config": lambda: AveragingConfig(ledger_rounds=65)}, "ledger_rounds must be an integer from 1"),
        ({"run_id": lambda: "has space"}, "run_id"),
    ],
)
def test_bad_configuration_raises_config_error(kwargs: dict, field: str) -> None:
    """Each setting is checked once, where its group is built (a config), or by PulseLoCo (the run id)."""
    model = make_model(0)
    with pytest.raises(ConfigError, match=field):
        PulseLoCo(model, make_inner_optimizer(model, 1e-4), **{name: make() for name, make in kwargs.items()})


def test_reset_outer_momentum_between_rounds_only() -> None:
    model = make_model(0)
    inner = make_inner_optimizer(model, 1e-3)
    opt = PulseLoCo(model, inner, round_config=RoundConfig(inner_steps=H, selector="dense"))
    _train(opt, model, inner, 2)
    assert opt.outer_optimizer.momentum_N is not None and opt.outer_optimizer.momentum_N.any()
    theta = opt.theta_N.clone()
    opt.reset_outer_momentum()
    assert not opt.outer_optimizer.momentum_N.any()
    assert _bits_equal(opt.theta_N, theta)  # only the momentum changes
    opt.step(loss=inner_step(model, inner, batch(0, 99)))
    with pytest.raises(RuntimeError, match="middle of a round"):
        opt.reset_outer_momentum()


def test_catch_up_between_rounds_only_and_a_peer_alone_keeps_its_state() -> None:
    model = make_model(0)
    inner = make_inner_optimizer(model, 1e-3)
    opt = PulseLoCo(model, inner, round_config=RoundConfig(inner_steps=H, selector="dense"))
    _train(opt, model, inner, 1)
    theta = opt.theta_N.clone()
    assert opt.catch_up() is False  # no swarm to catch up with
    assert _bits_equal(opt.theta_N, theta) and opt.round == 1 and opt.num_boundaries == 1
    opt.step(loss=inner_step(model, inner, batch(0, 99)))
    with pytest.raises(RuntimeError, match="between rounds"):
        opt.catch_up()


def test_a_diverged_round_drops_its_local_progress_and_restarts_from_theta(caplog: pytest.LogCaptureFixture) -> None:
    model = make_model(0)
    inner = make_inner_optimizer(model, 1e-3)
    opt = PulseLoCo(model, inner, round_config=RoundConfig(inner_steps=H, selector="dense"))
    _train(opt, model, inner, 1)
    expected, outer = opt.theta_N.clone(), copy.deepcopy(opt.outer_optimizer)
    outer.step(expected, torch.zeros_like(expected))  # the round's average is zero: only the momentum moves theta
    for i in range(H):
        inner_step(model, inner, batch(0, 50 + i))
        if i == H - 2:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")  # a blown-up step (NaN moments follow)
        opt.count_inner_step()
    assert "non-finite parameters" in caplog.text
    assert _bits_equal(opt.theta_N, expected)
    assert _bits_equal(flat_params(model), opt.theta_N)  # the model restarts from theta
    assert not inner.state  # the non-finite moments are gone
    assert torch.isfinite(opt.residual_N).all() and not opt.residual_N.any()


def _train_overlapped(
    opt: PulseLoCo, model: torch.nn.Module, inner: torch.optim.Optimizer, first_phase: int, num_phases: int
) -> list[tuple[int, int]]:
    """Overlapped rounds: ``num_phases`` inner phases from ``first_phase``; returns (phase at delivery, round) of
    every round the listeners received (the phase is ``-1`` for one landed after the loop, by the caller)."""
    delivered: list[tuple[int, int]] = []
    phase = -1
    opt.add_round_listener(lambda _opt, m: delivered.append((phase, m.round)) if m is not None else None)
    for phase in range(first_phase, first_phase + num_phases):
        for i in range(H):
            opt.step(loss=inner_step(model, inner, batch(0, phase * H + i)))
            opt.zero_grad()
    phase = -1
    return delivered


def test_overlapped_rounds_land_one_round_late_on_the_blocking_trajectory_of_plain_averaging() -> None:
    """Alone, with every entry sent and the outer step theta - average (lr 1, no momentum), starting the next phase
    from theta minus the phase's own pseudo-gradient is exactly the next theta: the overlapped run must follow
    the blocking one bit for bit, its rounds landing one boundary late and the last one at ``finish``."""
    config = {"inner_steps": H, "selector": "dense", "outer_lr": 1.0, "outer_momentum": 0.0}
    model = make_model(0)
    inner = make_inner_optimizer(model, 1e-3)
    blocking = PulseLoCo(model, inner, round_config=RoundConfig(**config))
    digests = _train(blocking, model, inner, 4)

    model = make_model(0)
    inner = make_inner_optimizer(model, 1e-3)
    opt = PulseLoCo(model, inner, round_config=RoundConfig(**config, overlap=True))
    landed: list[str] = []
    opt.add_round_listener(lambda _opt, m: landed.append(m.theta_digest) if m is not None else None)
    delivered = _train_overlapped(opt, model, inner, 0, 4)
    assert delivered == [(1, 0), (2, 1), (3, 2)]
    assert opt.last_metrics is not None and opt.last_metrics.round == 2
    final = opt.finish()
    assert final is not None and final.round == 3 and delivered[-1] == (-1, 3)
    assert opt.finish() is None  # nothing in flight any more
    assert opt.round == 4
    assert _bits_equal(opt.theta_N, blocking.theta_N)
    assert _bits_equal(flat_params(model), opt.theta_N)
    assert landed == digests


def test_overlapped_finish_mid_phase_keeps_the_phase_progress_on_the_landed_theta() -> None:
    """Training that ends mid-phase with overlap (a phase shortened to realign, ``PulseLoCo._realign``): ``finish``
    lands the round in flight and the model holds that theta plus what the phase trained since its start, as the
    next boundary would have started it (not the phase's local weights, which lack the landed round)."""
    model = make_model(0)
    inner = make_inner_optimizer(model, 1e-3)
    opt = PulseLoCo(model, inner, round_config=RoundConfig(inner_steps=H, selector="dense", overlap=True))
    _train_overlapped(opt, model, inner, 0, 2)
    for i in range(H - 1):
        opt.step(loss=inner_step(model, inner, batch(0, 2 * H + i)))
        opt.zero_grad()
    assert opt._start_N is not None
    progress_N = flat_params(model) - opt._start_N
    final = opt.finish()
    assert final is not None and final.round == 1 and opt.local_step == H - 1
    torch.testing.assert_close(flat_params(model), opt.theta_N + progress_N)
    assert not torch.equal(flat_params(model), opt.theta_N)


@pytest.mark.parametrize("selector", ["pulse", "sparseloco"])
def test_overlapped_resume_from_state_dict_continues_the_same_trajectory(selector: str, tmp_path: Path) -> None:
    """A state saved at a boundary with the round in flight (``state_dict`` waits for it) resumes on the straight
    run's trajectory: the local model restarts from the saved phase start, not from theta."""

    def fresh(seed: int = 0) -> tuple[PulseLoCo, torch.nn.Module, torch.optim.Optimizer]:
        model = make_model(seed)
        inner = make_inner_optimizer(model, 1e-4)
        return (
            PulseLoCo(model, inner, round_config=RoundConfig(inner_steps=H, selector=selector, overlap=True)),
            model,
            inner,
        )

    opt, model, inner = fresh()
    _train_overlapped(opt, model, inner, 0, 4)
    opt.finish()
    straight = opt.theta_N.clone()

    opt, model, inner = fresh()
    _train_overlapped(opt, model, inner, 0, 2)
    state = opt.state_dict()
    assert state["round"] == 2 and not torch.equal(state["start_N"], state["theta_N"])
    torch.save(state, tmp_path / "state.pt")

    opt, model, inner = fresh(seed=123)  # a different init: everything must come from the state
    opt.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    assert _bits_equal(flat_params(model), state["start_N"])
    _train_overlapped(opt, model, inner, 2, 2)
    opt.finish()
    assert _bits_equal(opt.theta_N, straight)
    assert _bits_equal(flat_params(model), straight)

    # the same state mid-round cannot resume blocking rounds: their inner steps would start from theta
    mid_round = {**state, "local_step": 1}
    blocking = PulseLoCo(make_model(0), None, round_config=RoundConfig(inner_steps=H, selector=selector))
    with pytest.raises(ConfigError, match="overlap=True"):
        blocking.load_state_dict(mid_round)
    assert blocking.round == 0
