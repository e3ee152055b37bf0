"""Loading pretrained causal LMs and their tokenizers (Hugging Face format) with one-line errors.

``model_name_or_path`` is a local directory written by ``save_pretrained`` (``config.json``, safetensors weights,
tokenizer files, and the chat template when the model has one) or, on a machine with internet, a hub name.
Before any weights are read, :func:`check_pretrained` says which of these is wrong: the path does not exist,
is not a causal language model, has no tokenizer, or would not fit in memory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import psutil
import torch

from pulseloco.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "TRAINING_BYTES_PER_PARAMETER",
    "available_memory_bytes",
    "check_pretrained",
    "load_causal_lm",
    "load_tokenizer",
    "random_causal_lm",
]

TRAINING_BYTES_PER_PARAMETER = 16 + 12
"""FP32 weights, gradients and AdamW's two moments, plus PulseLoCo's theta, residual and outer momentum."""

_LOCAL_HINT = (
    "give a local directory in Hugging Face format (config.json, *.safetensors, tokenizer files), "
    "for example one made by `python scripts/warm_model.py`"
)


def random_causal_lm(
    arch: str = "llama", *, seed: int | None = 0, dtype: torch.dtype = torch.float32, **config: Any
) -> Any:
    """A randomly initialized causal LM built from a config (no weights downloaded): the models the tests, the
    soak and the benchmarks train. ``arch``: a transformers model type (``llama``, ``qwen2``); ``config``: its
    config's fields (sizes, vocabulary, tied embeddings, ...); ``seed`` seeds torch's generator first (the same
    seed gives the same weights in every process; None leaves it alone, as under ``torch.device("meta")``).
    Raises :class:`ConfigError` for a model type transformers does not know."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        model_config = AutoConfig.for_model(arch, **config)
    except ValueError as exc:  # an unrecognized model type
        raise ConfigError(f"unknown model type {arch!r}: {' '.join(str(exc).split())[:200]}") from None
    if seed is not None:
        torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(model_config).to(dtype)


def _looks_local(name: str) -> bool:
    """A path rather than a hub name (``org/name``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def available_memory_bytes(device: torch.device | str = "cpu") -> int | None:
    """Free memory of ``device`` (CUDA: free device memory; CPU: psutil's ``available``, the kernel's
    ``MemAvailable`` on Linux), ``None`` if the platform does not tell."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, NotImplementedError):
        return None


def _load_config(model_name_or_path: str) -> Any:
    from transformers import AutoConfig

    path = Path(model_name_or_path).expanduser()
    if _looks_local(model_name_or_path) and not path.exists():
        raise ConfigError(f"model_name_or_path {model_name_or_path!r} does not exist; {_LOCAL_HINT}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"model_name_or_path {model_name_or_path!r} has no config.json; {_LOCAL_HINT}")
    try:
        return AutoConfig.from_pretrained(str(path) if path.exists() else model_name_or_path)
    except (OSError, ValueError) as exc:  # no such hub repo, no internet, unknown model type
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"cannot load the config of {model_name_or_path!r} ({reason}); {_LOCAL_HINT}") from None


def count_parameters(config: Any) -> int:
    """Parameters of the causal LM ``config`` describes, counted on the meta device (nothing is allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def check_pretrained(
    model_name_or_path: str,
    *,
    bytes_per_parameter: float = TRAINING_BYTES_PER_PARAMETER,
    num_local_processes: int = 1,
    device: torch.device | str = "cpu",
) -> Any:
    """Validate ``model_name_or_path`` before loading it; returns its ``transformers`` config.

    Raises :class:`ConfigError` with one line saying what is wrong and what to do: the path does not exist or
    has no ``config.json``, the config is not a causal language model, there is no tokenizer, or the model needs
    more than the free memory of ``device`` (``bytes_per_parameter`` times its parameters, per local process).
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    config = _load_config(model_name_or_path)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"model_name_or_path {model_name_or_path!r} is a {config.model_type!r} model, not a causal language "
            f"model; give a decoder-only LM such as Llama, Qwen2 or GPT-2"
        )
    load_tokenizer(model_name_or_path)
    num_params = count_parameters(config)
    device = torch.device(device)
    processes_here = num_local_processes if device.type == "cpu" else 1
    needed = num_params * bytes_per_parameter * processes_here
    available = available_memory_bytes(device)
    if available is not None and needed > available:
        raise ConfigError(
            f"{model_name_or_path!r} does not fit: {num_params / 1e6:.1f}M parameters need about "
            f"{needed / 2**30:.1f} GiB on {device} ({bytes_per_parameter:g} bytes each x {processes_here} "
            f"process(es)) but {available / 2**30:.1f} GiB is free; use a smaller model, fewer processes or "
            "a bigger device"
        )
    return config


def load_tokenizer(model_name_or_path: str) -> Any:
    """The model's own tokenizer (and chat template, when it has one), with a pad token.

    Raises :class:`ConfigError` when the directory or hub repo has no tokenizer.
    """
    from transformers import AutoTokenizer

    path = Path(model_name_or_path).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else model_name_or_path)
    except (OSError, ValueError, TypeError) as exc:
        reason = " ".join(str(exc).split())[:160]
        raise ConfigError(
            f"model_name_or_path {model_name_or_path!r} has no usable tokenizer ({reason}); save one beside the "
            "model with tokenizer.save_pretrained(DIR)"
        ) from None
    if not getattr(tokenizer, "is_fast", False) and not hasattr(tokenizer, "encode"):
        raise ConfigError(f"model_name_or_path {model_name_or_path!r} has no text tokenizer")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    model_name_or_path: str,
    *,
    dtype: torch.dtype | str | None = None,
    bytes_per_parameter: float | None = None,
    num_local_processes: int = 1,
    device: torch.device | str = "cpu",
) -> Any:
    """Check (:func:`check_pretrained`) and load a causal LM. ``dtype`` defaults to the checkpoint's own;
    ``bytes_per_parameter`` defaults to training (:data:`TRAINING_BYTES_PER_PARAMETER`).

    Raises :class:`ConfigError` as :func:`check_pretrained` does, or when the weights cannot be read.
    """
    from transformers import AutoModelForCausalLM

    check_pretrained(
        model_name_or_path,
        bytes_per_parameter=TRAINING_BYTES_PER_PARAMETER if bytes_per_parameter is None else bytes_per_parameter,
        num_local_processes=num_local_processes,
        device=device,
    )
    path = Path(model_name_or_path).expanduser()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path) if path.exists() else model_name_or_path, dtype=dtype if dtype is not None else "auto"
        )
    except (OSError, ValueError, RuntimeError) as exc:  # missing or damaged weight files
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"cannot load the weights of {model_name_or_path!r} ({reason})") from None
    return model.to(torch.device(device))  # type: ignore[arg-type]  # transformers' decorator hides the signature
