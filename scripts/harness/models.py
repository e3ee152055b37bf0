"""The models the benchmarks build, and how they train them.

- :data:`MODEL_CONFIGS`, :func:`build_model`, :func:`state_shapes`: Qwen2 (Llama with q/k/v biases) built from a
  config, random init, seeded; what bench_codec, bench_sync and bench_memory measure.
- :func:`llama`: a small Llama from its sizes (the soak's and bench_loco's peers).
- :class:`SyntheticLM`: a :func:`build_model` model taking AdamW steps on LM cross-entropy over seeded random token
  ids (bench_codec's real updates, bench_sync's trainer).
- :func:`warm_model_dir`: the cached warm model of ``scripts/warm_model.py --size SIZE`` (built once).
- :func:`grow_llama`: a warm Llama grown in depth and MLP width, cached (bench_rollouts' rate-limited cases).

All build on :func:`pulseloco.models.random_causal_lm`. torch and transformers are imported inside the
functions: a benchmark's coordinator imports this module without loading them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import REPO, SCRIPTS

_CONFIG_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "tie_word_embeddings", "max_position_embeddings",
)  # fmt: skip
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    name: dict(zip(_CONFIG_FIELDS, values))
    for name, values in {
        "default": (768, 12, 12, 2, 2048, 32000, False, 512),  # ~122M parameters
        "1b": (2048, 22, 32, 4, 5632, 32000, False, 2048),  # ~1.1B (a TinyLlama-sized model): the GPU benchmark
        "small": (256, 4, 4, 2, 688, 8000, False, 512),  # ~7M: a quick smoke run (tests)
        "tiny": (96, 2, 4, 2, 256, 2000, False, 256),  # ~0.6M: the test suite's smoke runs (same code, less CPU)
    }.items()
}
"""The Qwen2 configs of :func:`build_model`, by name: sizes, vocabulary, untied embeddings."""
MIN_DEFAULT_PARAMS = 100_000_000
WARM_MODEL_TIMEOUT = 3600.0
"""Seconds ``scripts/warm_model.py`` may take to build a warm model (reusing a cached one takes seconds)."""


def build_model(config_name: str, seed: int) -> Any:
    """A randomly initialised FP32 Qwen2ForCausalLM from MODEL_CONFIGS, seeded, in training mode.

    Raises KeyError for an unknown config, RuntimeError if the default model has fewer than MIN_DEFAULT_PARAMS
    parameters.
    """
    from pulseloco.models import random_causal_lm

    model = random_causal_lm("qwen2", seed=seed, **MODEL_CONFIGS[config_name])
    num_params = sum(p.numel() for p in model.parameters())
    if config_name == "default" and num_params < MIN_DEFAULT_PARAMS:
        raise RuntimeError(f"default model has {num_params} parameters, expected >= {MIN_DEFAULT_PARAMS}")
    return model.float().train()


def state_shapes(config_name: str) -> dict[str, list[int]]:
    """Names and shapes of the model's floating state dict (what a publisher publishes), without weights."""
    import torch

    from pulseloco.models import random_causal_lm

    with torch.device("meta"):
        model = random_causal_lm("qwen2", seed=None, **MODEL_CONFIGS[config_name])
    return {name: list(t.shape) for name, t in model.state_dict().items() if t.is_floating_point()}


def llama(
    *,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    max_position_embeddings: int,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
    seed: int | None = 0,
) -> Any:
    """A Llama with random weights (the same in every process for the same ``seed``), untied embeddings; key/value
    heads default to the attention heads, the MLP width to about 8/3 of the hidden size (a multiple of 8)."""
    from pulseloco.models import random_causal_lm

    return random_causal_lm(
        "llama",
        seed=seed,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size if intermediate_size is not None else hidden_size * 8 // 3 // 8 * 8,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads if num_key_value_heads is not None else num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
    )


class SyntheticLM:
    """A :func:`build_model` model (seed ``seed``) with AdamW at ``lr`` (betas 0.9/0.999, no weight decay), trained
    on LM cross-entropy over random token ids: a new ``batch_size`` x ``seq_len`` batch every step, drawn from a
    generator seeded ``seed + 1``. The same arguments give the same updates in every process."""

    def __init__(
        self, config_name: str, seed: int, lr: float, *, device: str = "cpu", batch_size: int = 2, seq_len: int = 64
    ) -> None:
        import torch

        self.model = build_model(config_name, seed).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        self.vocab = int(self.model.config.vocab_size)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.device, self.batch_size, self.seq_len = device, batch_size, seq_len

    def step(self) -> tuple[float, float]:
        """One optimizer step; returns its loss and seconds. The gradients are freed afterwards."""
        import torch

        t0 = time.perf_counter()
        ids = torch.randint(0, self.vocab, (self.batch_size, self.seq_len), generator=self.generator).to(self.device)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss), time.perf_counter() - t0


def warm_model_dir(size: str, *, timeout: float = WARM_MODEL_TIMEOUT) -> Path:
    """``scripts/warm_model.py --size SIZE`` (built once and cached, then reused): the directory it prints last as
    ``warm model: DIR``. Its progress goes to stderr. Raises RuntimeError when it fails, prints no such line or takes
    over ``timeout`` seconds."""
    argv = [sys.executable, str(SCRIPTS / "warm_model.py"), "--size", size]
    try:
        proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"scripts/warm_model.py --size {size} took over {timeout:.0f} s") from None
    found = re.findall(r"^warm model: (.+)$", proc.stdout, flags=re.MULTILINE)
    if proc.returncode != 0 or not found or not Path(found[-1].strip()).is_dir():
        tail = " | ".join(proc.stdout.strip().splitlines()[-3:])
        raise RuntimeError(
            f"scripts/warm_model.py --size {size} exited {proc.returncode} without a `warm model: DIR` line ({tail})"
        )
    return Path(found[-1].strip())


def cache_dir() -> Path:
    """Where models are cached: ``$PULSELOCO_CACHE`` or ``~/.cache/pulseloco``, then ``models/``."""
    return Path(os.environ.get("PULSELOCO_CACHE") or Path.home() / ".cache" / "pulseloco") / "models"


def grow_llama(base: str, layers: int, intermediate: int, norm_scale: float, seed: int) -> tuple[str, dict[str, Any]]:
    """The warm Llama in ``base`` grown to ``layers`` decoder layers and MLP width ``intermediate``: its weights
    copied in, the rest N(0, 0.02) (seeded), the new layers' RMSNorm weights set to ``norm_scale`` so that they barely
    move the residual stream and the warm model's answers survive. Cached by a hash of the settings under
    :func:`cache_dir` as ``bench-rollouts-<hash>``. Returns its directory and a description (parameters, BF16 bytes,
    greedy reward of the base and the grown model on 64 problems). Raises RuntimeError for a weight it cannot grow
    (another architecture)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from pulseloco.recipes import tasks
    from pulseloco.rollouts.engines.hf import TransformersEngine

    key = json.dumps([base, layers, intermediate, norm_scale, seed, 1])
    cache = cache_dir()
    out = cache / f"bench-rollouts-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    marker = out / "bench_rollouts_model.json"
    if marker.is_file():
        return str(out), json.loads(marker.read_text())
    small = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LlamaConfig.from_pretrained(base)
    old_layers, old_inter = cfg.num_hidden_layers, cfg.intermediate_size
    cfg.num_hidden_layers, cfg.intermediate_size = layers, intermediate
    torch.manual_seed(seed)
    big = LlamaForCausalLM(cfg)  # N(0, initializer_range=0.02) everywhere, norms 1
    big_sd, small_sd = big.state_dict(), small.state_dict()
    with torch.no_grad():
        for name, t in small_sd.items():
            target = big_sd[name]
            if target.shape == t.shape:
                target.copy_(t)
            elif name.endswith(("gate_proj.weight", "up_proj.weight")):
                target[:old_inter].copy_(t)
            elif name.endswith("down_proj.weight"):
                target[:, :old_inter].copy_(t)
            else:
                raise RuntimeError(f"cannot grow {name}: {tuple(t.shape)} -> {tuple(target.shape)}")
        for i in range(old_layers, layers):  # new layers: small norms so they barely move the residual stream
            big.model.layers[i].input_layernorm.weight.fill_(norm_scale)
            big.model.layers[i].post_attention_layernorm.weight.fill_(norm_scale)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=cache))
    big.save_pretrained(tmp)
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "pulseloco_warm.json"):
        if (Path(base) / extra).is_file():
            shutil.copy2(Path(base) / extra, tmp / extra)
    problems = tasks.eval_problems(tasks.spec_for_model(base, None, None), 64)

    def reward(model_dir: Path) -> float:
        engine = TransformersEngine.from_pretrained(str(model_dir))
        return tasks.score(engine.generate([p for p, _ in problems], max_new_tokens=6), problems)

    num_params = sum(p.numel() for p in big.parameters())
    info = {
        "base": base,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "hidden_size": cfg.hidden_size,
        "new_layer_norm_scale": norm_scale,
        "num_params": num_params,
        "bf16_bytes": 2 * num_params,
        "greedy_reward_base": reward(Path(base)),
        "greedy_reward_grown": reward(tmp),
    }
    (tmp / "bench_rollouts_model.json").write_text(json.dumps(info, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return str(out), info
