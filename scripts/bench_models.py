"""The models the benchmarks measure: Qwen2 (Llama with q/k/v biases) built from a config, random init, seeded.

Shared by scripts/bench_codec.py and scripts/bench_sync.py so both measure the same model. torch and transformers
are imported lazily: benchmark coordinators import this module without loading them.
"""

from __future__ import annotations

from typing import Any

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # ~122M parameters.
    "default": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=2048,
        vocab_size=32000,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    ),
    # ~1.1B parameters (a TinyLlama-sized model): the GPU benchmark.
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=5632,
        vocab_size=32000,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
    ),
    # ~7M parameters: a quick smoke run (tests).
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=8000,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    ),
    # ~0.6M parameters: the test suite's smoke runs (the same code paths, a fraction of the CPU time).
    "tiny": dict(
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=2000,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    ),
}
MIN_DEFAULT_PARAMS = 100_000_000


def build_model(config_name: str, seed: int) -> Any:
    """A randomly initialised FP32 Qwen2ForCausalLM from MODEL_CONFIGS, seeded.

    Raises RuntimeError if the default model has fewer than MIN_DEFAULT_PARAMS parameters.
    """
    from pulseloco.integrations.models import random_causal_lm

    model = random_causal_lm("qwen2", seed=seed, **MODEL_CONFIGS[config_name])
    num_params = sum(p.numel() for p in model.parameters())
    if config_name == "default" and num_params < MIN_DEFAULT_PARAMS:
        raise RuntimeError(f"default model has {num_params} parameters, expected >= {MIN_DEFAULT_PARAMS}")
    return model.float().train()


def state_shapes(config_name: str) -> dict[str, list[int]]:
    """Names and shapes of the model's floating state dict (what a publisher publishes), without weights."""
    import torch

    from pulseloco.integrations.models import random_causal_lm

    with torch.device("meta"):
        model = random_causal_lm("qwen2", seed=None, **MODEL_CONFIGS[config_name])
    return {name: list(t.shape) for name, t in model.state_dict().items() if t.is_floating_point()}
