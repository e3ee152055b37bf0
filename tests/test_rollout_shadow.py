"""TransformersEngine's host shadow: what a rollout worker on a GPU patches and digests instead of the GPU tensors.

The shadow path is forced on a CPU model here (``shadow=True``), so the code a GPU worker runs is exercised on
this machine: the subscriber's patch lands in the shadow only, and ``weights_updated`` carries exactly the
changed elements (or, after an anchor, everything) to the model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from codec_helpers import assert_state_bits_equal, changed_copy, random_mask

from pulseloco.models import random_causal_lm
from pulseloco.rollouts.engines.hf import TransformersEngine
from pulseloco.sync import apply_patch, make_patch, state_digest


class _Tokenizer:
    padding_side = "right"


def _model(tied: bool) -> Any:
    return random_causal_lm(
        "llama", seed=0, dtype=torch.bfloat16, vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip


def _params(engine: TransformersEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items() if v.is_floating_point()}


@pytest.mark.parametrize("tied", [False, True])
def test_shadow_takes_the_patch_and_the_model_gets_only_the_changes(tied: bool) -> None:
    engine = TransformersEngine(_model(tied), _Tokenizer(), shadow=True)
    weights = engine.weights()
    before = _params(engine)
    assert all(weights[k].data_ptr() != engine.model.state_dict()[k].data_ptr() for k in weights)
    assert_state_bits_equal(weights, before)
    if tied:  # one shadow tensor for the tied pair, as in the model
        assert weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()

    gen = torch.Generator().manual_seed(1)
    target = {k: changed_copy(v, random_mask(v.shape, 0.1, gen), gen) for k, v in weights.items()}
    if tied:
        target["lm_head.weight"] = target["model.embed_tokens.weight"]
    payload = make_patch(weights, target, version=1, base_version=0)
    info = apply_patch(weights, payload)
    assert info.digest == state_digest(target)
    assert_state_bits_equal(_params(engine), before)  # the model is untouched until weights_updated

    engine.weights_updated(info.changed, version=1)
    assert_state_bits_equal(_params(engine), target)


def test_without_changed_indices_everything_is_copied() -> None:
    engine = TransformersEngine(_model(False), _Tokenizer(), shadow=True)
    for t in engine.weights().values():
        t.add_(1.0)
    expected = {k: v.clone() for k, v in engine.weights().items()}
    engine.weights_updated(None, version=2)
    assert_state_bits_equal(_params(engine), expected)


def test_cpu_model_has_no_shadow_by_default() -> None:
    engine = TransformersEngine(_model(False), _Tokenizer())
    assert not engine.shadow
    state = engine.model.state_dict()
    assert all(engine.weights()[k].data_ptr() == state[k].data_ptr() for k in engine.weights())


def test_an_fp32_model_computes_on_exactly_the_published_bf16_values() -> None:
    """A model that computes in FP32 (the CPU worker's default: BF16 matrix products are slow on most CPUs) gets a
    BF16 shadow by default: the subscriber patches and digests BF16 tensors, the model's values from the start and
    after every patch are exactly those BF16 values, widened, and the patch reaches only the changed elements."""
    engine = TransformersEngine(_model(False).float(), _Tokenizer())
    weights = engine.weights()
    assert engine.shadow and all(t.dtype == torch.bfloat16 for t in weights.values())
    assert all(t.dtype == torch.float32 for t in _params(engine).values())
    assert_state_bits_equal(_params(engine), {k: v.float() for k, v in weights.items()})

    gen = torch.Generator().manual_seed(2)
    target = {k: changed_copy(v, random_mask(v.shape, 0.1, gen), gen) for k, v in weights.items()}
    info = apply_patch(weights, make_patch(weights, target, version=1, base_version=0))
    assert info.digest == state_digest(target)
    engine.weights_updated(info.changed, version=1)
    assert_state_bits_equal(_params(engine), {k: v.float() for k, v in target.items()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the shadow path runs on CPU above")
def test_gpu_model_gets_a_host_shadow() -> None:
    engine = TransformersEngine(_model(False).cuda(), _Tokenizer())
    assert engine.shadow and all(t.device.type == "cpu" for t in engine.weights().values())
    gen = torch.Generator().manual_seed(2)
    weights = engine.weights()
    target = {k: changed_copy(v, random_mask(v.shape, 0.1, gen), gen) for k, v in weights.items()}
    info = apply_patch(weights, make_patch(weights, target, version=1, base_version=0))
    engine.weights_updated(info.changed, version=1)
    assert_state_bits_equal({k: v.cpu() for k, v in _params(engine).items()}, target)
