"""Shared plumbing of the recipes: configuration, strategies, metrics, checkpoints, error reporting.

Kept thin on purpose: a recipe reads top to bottom (``get_dataloaders`` / ``training_function`` / ``main``, as in
accelerate's ``examples/``) and calls into this module only for what every recipe does the same way.

Configuration
    One schema (:class:`RecipeConfig`) of typed sections, loaded from a YAML file in ``recipes/configs/`` and
    overridden on the command line with ``--section.field value`` or, when the field name is unique among the
    recipe's sections, ``--field value`` (``-`` and ``_`` are interchangeable). Unknown keys, wrong types and
    out-of-range values end the run with one line naming the field.

Strategies (``--strategy``)
    ``ddp``: plain data-parallel across the processes of one ``accelerate launch`` (gradients all-reduced every
    step). ``diloco`` / ``pulseloco`` / ``sparseloco``: this launch is one swarm peer; PulseLoCo runs the outer
    rounds with the ``dense`` / ``pulse`` / ``topk`` selector. Only the main process joins the DHT; the others
    receive the global parameters by broadcast (see :class:`pulseloco.PulseLoCo`).

Heavy imports (torch, transformers, hivemind) happen inside functions, so that a bad configuration is reported
before they load (seconds on a busy machine).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import json
import logging
import math
import os
import sys
import time
import typing
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pulseloco.errors import ConfigError, PulseLocoError

logger = logging.getLogger(__name__)

RECIPES_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = RECIPES_DIR / "configs" / "tiny.yaml"

STRATEGIES: dict[str, str | None] = {"ddp": None, "diloco": "dense", "pulseloco": "pulse", "sparseloco": "topk"}
"""Strategy name -> PulseLoCo selector (``None``: no swarm, plain data-parallel)."""

EXIT_CONFIG_ERROR = 2


# ---- configuration sections -------------------------------------------------------------------------------


def _positive(section: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"{section}.{name} must be {'>= 0' if allow_zero else 'positive'}, got {value}")


@dataclass(kw_only=True)
class ModelConfig:
    """A transformers causal LM built from a config (random init, nothing downloaded)."""

    arch: str = "llama"
    """Architecture: ``llama`` or ``qwen2``."""
    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 128
    """Width of the MLP."""
    num_layers: int = 2
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads (must divide hidden_size)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention; must divide num_heads)."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes the tokenizer's."""
    max_position_embeddings: int = 256
    """Longest sequence the model accepts (prompt plus completion)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head."""

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ConfigError(f"model.arch must be 'llama' or 'qwen2', got {self.arch!r}")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            _positive("model", name, getattr(self, name))
        _positive("model", "max_position_embeddings", self.max_position_embeddings)
        _positive("model", "vocab_size", self.vocab_size, allow_zero=True)
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({self.num_kv_heads})"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(
                f"model.hidden_size / model.num_heads = {self.hidden_size // self.num_heads} must be even (RoPE)"
            )

    def num_parameters(self, vocab_size: int) -> int:
        """Parameter count of the model this config builds (Llama/Qwen2 layout), without building it."""
        h, i, head_dim = self.hidden_size, self.intermediate_size, self.hidden_size // self.num_heads
        kv = self.num_kv_heads * head_dim
        attention = 2 * h * h + 2 * h * kv + (h + 2 * kv if self.arch == "qwen2" else 0)
        per_layer = attention + 3 * h * i + 2 * h
        embeddings = vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h


@dataclass(kw_only=True)
class TrainConfig:
    """Settings every recipe shares: seed, logging, checkpoints, precision."""

    seed: int = 0
    """Seed of the model initialization (the same on every peer) and of the data order."""
    output_dir: str = "runs/default"
    """Metrics (``metrics.jsonl``), checkpoints and TensorBoard logs go here; one directory per peer."""
    resume: bool = False
    """Continue from ``output_dir/checkpoint.pt``."""
    checkpoint_every: int = 0
    """Inner steps between checkpoints (rounded up to an outer-round boundary); 0: only at the end."""
    log_every: int = 1
    """Inner steps between step-level metrics lines."""
    mixed_precision: str = "no"
    """``no``, ``bf16`` or ``fp16`` (accelerate autocast; master weights stay FP32)."""
    tensorboard: bool = True
    """Also write TensorBoard logs to ``output_dir/tb`` when tensorboard is installed (never required)."""
    num_threads: int = 0
    """torch CPU threads per process; 0 keeps torch's default."""
    log_level: str = "WARNING"
    """Python logging level (pulseloco logs rounds at INFO)."""

    def __post_init__(self) -> None:
        _positive("train", "checkpoint_every", self.checkpoint_every, allow_zero=True)
        _positive("train", "log_every", self.log_every)
        _positive("train", "num_threads", self.num_threads, allow_zero=True)
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ConfigError(f"train.mixed_precision must be no, bf16 or fp16, got {self.mixed_precision!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"train.log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")


@dataclass(kw_only=True)
class SwarmOptions:
    """The strategy, and for swarm strategies how this peer joins and averages."""

    strategy: str = "pulseloco"
    """``ddp``, ``diloco`` (dense pseudo-gradients), ``pulseloco`` (compute-visible gate) or ``sparseloco`` (top-k)."""
    run_id: str = "pulseloco"
    """Peers with the same run_id average together (and rollout workers follow ``<run_id>.policy``)."""
    peer_index: int | None = None
    """Salt of this peer's data order; default: derived from the peer id (give each peer its own to reproduce)."""
    inner_steps: int = 8
    """H: inner steps per outer round (also the publishing interval under ddp)."""
    outer_lr: float = 0.7
    """Nesterov outer learning rate."""
    outer_momentum: float = 0.9
    """Nesterov outer momentum."""
    topk_density: float = 0.01
    """sparseloco: fraction of each chunk sent."""
    topk_chunk_size: int = 4096
    """sparseloco: chunk size of the top-k selection."""
    target_group_size: int | None = None
    """Start a round as soon as this many peers are there; None: wait the whole matchmaking_time."""
    matchmaking_time: float = 15.0
    """Seconds to gather peers for a round."""
    averaging_timeout: float = 60.0
    """Seconds a round's exchange may take."""
    request_timeout: float = 10.0
    """Seconds for one DHT operation or message."""
    linger: float = 5.0
    """Seconds to stay in the swarm after the last round, so that slower peers and rollout workers finish."""
    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of peers in the swarm (from ``pulseloco dht`` or another peer); empty: start a new swarm."""
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    """Addresses to listen on (``/ip4/0.0.0.0/tcp/PORT`` for a public peer)."""
    announce_maddrs: list[str] = field(default_factory=list)
    """Addresses others should dial (public address behind port forwarding)."""
    client_mode: bool = False
    """Behind NAT: connect out only, serve nothing (needs initial_peers)."""
    identity: str | None = None
    """Identity file that keeps the peer id (and multiaddr) across restarts; created if missing."""
    swarm_key: str | None = None
    """Shared swarm key file: only its holders can join (``pulseloco dht --new-swarm-key``)."""
    startup_timeout: float = 30.0
    """Seconds to start the DHT and reach the initial peers."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"swarm.strategy: unknown strategy {self.strategy!r} (choose from {', '.join(STRATEGIES)})"
            )
        if not self.run_id or any(c.isspace() for c in self.run_id) or len(self.run_id) > 100:
            raise ConfigError(f"swarm.run_id must be 1-100 characters without spaces, got {self.run_id!r}")
        _positive("swarm", "inner_steps", self.inner_steps)
        for name in ("outer_lr", "matchmaking_time", "averaging_timeout", "request_timeout", "startup_timeout"):
            _positive("swarm", name, getattr(self, name))
        _positive("swarm", "linger", self.linger, allow_zero=True)
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"swarm.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not 0 < self.topk_density <= 1:
            raise ConfigError(f"swarm.topk_density must be in (0, 1], got {self.topk_density}")
        _positive("swarm", "topk_chunk_size", self.topk_chunk_size)
        if self.target_group_size is not None:
            _positive("swarm", "target_group_size", self.target_group_size)

    @property
    def selector(self) -> str | None:
        return STRATEGIES[self.strategy]


@dataclass(kw_only=True)
class DataConfig:
    """pretrain: where the text comes from and how it becomes tokens."""

    paths: list[str] = field(default_factory=list)
    """Text (.txt, .md, .py, ...) or JSON-lines (.jsonl) files or directories; empty: the default corpus."""
    dataset: str | None = None
    """A ``datasets`` name (needs internet and the datasets package); used when paths is empty."""
    dataset_split: str = "train"
    """Split of ``dataset``."""
    text_field: str = "text"
    """Field holding the text in .jsonl records and dataset rows."""
    tokenizer: str = "bytes"
    """``bytes`` (byte-level, no download) or a transformers tokenizer name or path."""
    max_bytes: int = 4_000_000
    """Read at most this much text (the default corpus is the Python standard library's sources)."""
    eval_fraction: float = 0.02
    """Tail of the token stream held out for evaluation."""

    def __post_init__(self) -> None:
        _positive("data", "max_bytes", self.max_bytes)
        if not 0 < self.eval_fraction < 0.5:
            raise ConfigError(f"data.eval_fraction must be in (0, 0.5), got {self.eval_fraction}")


@dataclass(kw_only=True)
class PretrainConfig:
    """pretrain: the optimization."""

    steps: int = 64
    """Inner optimizer steps per process (a multiple of swarm.inner_steps for swarm strategies)."""
    batch_size: int = 8
    """Sequences per process per step."""
    seq_len: int = 64
    """Tokens per sequence."""
    lr: float = 1e-3
    """AdamW learning rate (the inner learning rate for swarm strategies)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    grad_clip: float = 1.0
    """Gradient norm clip; 0: off."""
    eval_every: int = 0
    """Inner steps between evaluations of the held-out loss; 0: only at the end."""
    eval_batches: int = 4
    """Batches of the held-out evaluation."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "lr", "eval_batches"):
            _positive("pretrain", name, getattr(self, name))
        for name in ("weight_decay", "warmup_steps", "grad_clip", "eval_every"):
            _positive("pretrain", name, getattr(self, name), allow_zero=True)


@dataclass(kw_only=True)
class GRPOConfig:
    """grpo: a short supervised warm-up, then GRPO with exact-match rewards on synthetic arithmetic."""

    task: str = "add"
    """``add`` (``12+7=`` -> ``19``) or ``sub`` (non-negative differences)."""
    max_operand: int = 9
    """Operands are drawn from 0..max_operand."""
    sft_steps: int = 32
    """Supervised warm-up steps (so that rewards are not all zero)."""
    sft_lr: float = 3e-3
    """Learning rate of the warm-up."""
    sft_batch_size: int = 32
    """Examples per process per warm-up step."""
    steps: int = 32
    """GRPO steps per process (sft_steps + steps is a multiple of swarm.inner_steps for swarm strategies)."""
    lr: float = 5e-6
    """GRPO learning rate (an RL learning rate, 1e-6..1e-5)."""
    prompts_per_step: int = 8
    """Prompts per process per GRPO step."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are normalized within each group."""
    max_new_tokens: int = 4
    """Longest completion."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    grad_clip: float = 1.0
    """Gradient norm clip; 0: off."""

    def __post_init__(self) -> None:
        if self.task not in ("add", "sub"):
            raise ConfigError(f"grpo.task must be 'add' or 'sub', got {self.task!r}")
        for name in ("max_operand", "sft_lr", "sft_batch_size", "steps", "lr", "prompts_per_step"):
            _positive("grpo", name, getattr(self, name))
        for name in ("max_new_tokens", "temperature"):
            _positive("grpo", name, getattr(self, name))
        _positive("grpo", "sft_steps", self.sft_steps, allow_zero=True)
        _positive("grpo", "grad_clip", self.grad_clip, allow_zero=True)
        if self.group_size < 2:
            raise ConfigError(f"grpo.group_size must be at least 2 (advantages compare a group), got {self.group_size}")


@dataclass(kw_only=True)
class PublishConfig:
    """grpo: PULSESync publishing of each consensus version to rollout workers."""

    publish: bool = False
    """Publish versions (peer 0 of a run sets this; every trainer may)."""
    signing_key: str | None = None
    """The publisher's private key (``pulseloco keygen --out PATH``)."""
    store_dir: str | None = None
    """Version store; default ``output_dir/versions``."""
    anchor_every: int = 10
    """A full BF16 anchor every this many versions."""

    def __post_init__(self) -> None:
        _positive("publish", "anchor_every", self.anchor_every)


@dataclass(kw_only=True)
class RolloutConfig:
    """rollout_worker: following the published versions and scoring samples."""

    public_key: str | None = None
    """The publisher's public key (``.pub`` written by ``pulseloco keygen``)."""
    num_prompts: int = 64
    """Prompts scored per received version (greedy decoding)."""
    interval: float = 1.0
    """Seconds between checks for a new version."""
    until_version: int | None = None
    """Exit once this version is reached; None: run until interrupted or max_seconds."""
    max_seconds: float = 0.0
    """Exit after this many seconds; 0: no limit."""
    update_timeout: float = 60.0
    """Seconds one update may take."""

    def __post_init__(self) -> None:
        _positive("rollout", "num_prompts", self.num_prompts)
        _positive("rollout", "interval", self.interval)
        _positive("rollout", "max_seconds", self.max_seconds, allow_zero=True)
        _positive("rollout", "update_timeout", self.update_timeout)


@dataclass(kw_only=True)
class RecipeConfig:
    """Every section a config file may hold; each recipe reads the ones it needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    swarm: SwarmOptions = field(default_factory=SwarmOptions)
    data: DataConfig = field(default_factory=DataConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    config_path: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(RecipeConfig)
    if f.default_factory is not dataclasses.MISSING
}


# ---- loading and overrides ----------------------------------------------------------------------------------


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field (torchtitan style), read from the source for ``--help``."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _coerce(key: str, value: Any, hint: Any, *, from_cli: bool) -> Any:
    """Convert ``value`` (YAML-typed, or a command-line string) to the field type ``hint``."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        if value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    if origin is list:
        items = value if isinstance(value, list) else [value]
        out: list[str] = []
        for item in items:
            if not isinstance(item, str):
                raise ConfigError(f"{key}: expected strings, got {item!r}")
            out.extend(item.replace(",", " ").split())
        return out
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "off", "0"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        if from_cli or isinstance(value, int | float):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {hint}")  # a schema bug, not a user error


def _all_keys() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _suggest(key: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _resolve_flag(flag: str, sections: Sequence[str]) -> str:
    """``--train.seed`` / ``--seed`` / ``--initial-peers`` -> ``section.field``."""
    name = flag[2:].replace("-", "_")
    keys = _all_keys()
    if "." in name:
        if name in keys:
            return name
        candidates = keys
    else:
        matches = [f"{s}.{name}" for s in sections if f"{s}.{name}" in keys]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise ConfigError(f"{flag} is ambiguous: use one of {', '.join('--' + m for m in matches)}")
        candidates = sorted({k.split(".", 1)[1] for k in keys if k.split(".", 1)[0] in sections})
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    hint = f" (did you mean --{close[0].replace('_', '-')}?)" if close else ""
    raise ConfigError(f"unknown option {flag}{hint}")


def _split_cli(argv: Sequence[str]) -> tuple[str | None, bool, list[tuple[str, list[str]]]]:
    """(config path, help requested, [(flag, values)]) from ``--flag v1 v2 --other=v``."""
    config_path: str | None = None
    wants_help = False
    items: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("-h", "--help"):
            wants_help = True
            i += 1
            continue
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}: options look like --key value")
        flag, _, inline = token.partition("=")
        values: list[str] = [inline] if inline else []
        i += 1
        while not inline and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if flag == "--config":
            if len(values) != 1:
                raise ConfigError("--config takes one path, e.g. --config recipes/configs/tiny.yaml")
            config_path = values[0]
        else:
            items.append((flag, values))
    return config_path, wants_help, items


def _load_yaml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config: {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: {path} must map section names to settings")
    keys = _all_keys()
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section {section!r}{_suggest(str(section), list(SECTIONS))}")
        if values is None:
            raw[section] = {}
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping of settings")
        for name in values:
            key = f"{section}.{name}"
            if key not in keys:
                raise ConfigError(f"{path}: unknown key {key!r}{_suggest(key, keys)}")
    return raw


def format_help(prog: str, description: str, sections: Sequence[str]) -> str:
    lines = [f"usage: accelerate launch {prog} [--config YAML] [--section.key VALUE ...]", "", description, ""]
    lines.append(f"  --config YAML   settings file (default {DEFAULT_CONFIG.relative_to(RECIPES_DIR.parent)})")
    for section in sections:
        cls = SECTIONS[section]
        lines += ["", f"{section}: {(cls.__doc__ or '').strip()}"]
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            lines.append(f"  --{section}.{f.name.replace('_', '-')} (default {default!r})")
            if f.name in docs:
                lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)


def load_config(argv: Sequence[str] | None, *, prog: str, description: str, sections: Sequence[str]) -> RecipeConfig:
    """The recipe's configuration: defaults < YAML file < command line. Raises :class:`ConfigError`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_arg, wants_help, items = _split_cli(argv)
    if wants_help:
        print(format_help(prog, description, sections))
        raise SystemExit(0)
    path = Path(config_arg) if config_arg else DEFAULT_CONFIG
    raw = _load_yaml(path)
    merged: dict[str, dict[str, Any]] = {section: dict(raw.get(section) or {}) for section in SECTIONS}
    typed: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for section, values in merged.items():
        hints = _field_types(SECTIONS[section])
        for name, value in values.items():
            typed[section][name] = _coerce(f"{path}: {section}.{name}", value, hints[name], from_cli=False)
    for flag, values in items:
        key = _resolve_flag(flag, sections)
        section, name = key.split(".", 1)
        hint = _field_types(SECTIONS[section])[name]
        if hint is bool and not values:
            typed[section][name] = True
            continue
        if typing.get_origin(hint) is list:
            typed[section][name] = _coerce(flag, values, hint, from_cli=True)
            continue
        if len(values) != 1:
            raise ConfigError(f"{flag} takes one value, got {len(values)}")
        typed[section][name] = _coerce(flag, values[0], hint, from_cli=True)
    built = {section: SECTIONS[section](**typed[section]) for section in SECTIONS}
    return RecipeConfig(**built, config_path=str(path))


# ---- running a recipe ----------------------------------------------------------------------------------------


def is_main_process() -> bool:
    """Rank 0 (or not launched by a distributed launcher), without initializing anything."""
    return os.environ.get("RANK", "0") == "0"


def run_recipe(prog: str, main: Callable[[], None]) -> None:
    """Run ``main``; a configuration error ends the process with one line on stderr and exit code 2."""
    try:
        main()
    except PulseLocoError as exc:
        if is_main_process():
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    except MemoryError:
        if is_main_process():
            print(f"{prog}: error: out of memory; use a smaller model or batch size", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def setup_logging(config: TrainConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def available_memory_bytes(device: Any) -> int | None:
    """Free memory of ``device`` (CUDA: free device memory; CPU: MemAvailable), None if unknown."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_model_fits(model: ModelConfig, vocab_size: int, *, swarm: bool, num_local_processes: int, device: Any) -> int:
    """Raise :class:`ConfigError` when the model would not fit in memory; returns its parameter count.

    Counts FP32 weights, gradients and AdamW's two moments per process, plus PulseLoCo's global parameters,
    residual and outer momentum (FP32 each) on a swarm peer; activations are not counted.
    """
    num_params = model.num_parameters(vocab_size)
    bytes_per_param = 16 + (12 if swarm else 0)
    processes_here = num_local_processes if device.type == "cpu" else 1
    needed = num_params * bytes_per_param * processes_here
    available = available_memory_bytes(device)
    if available is not None and needed > available:
        raise ConfigError(
            f"the model does not fit: {num_params / 1e6:.1f}M parameters need about {needed / 2**30:.1f} GiB "
            f"(weights, gradients, AdamW{', PulseLoCo state' if swarm else ''}) but {available / 2**30:.1f} GiB is "
            f"free on {device}; make it smaller (model.hidden_size, model.num_layers, model.vocab_size) "
            "or use a bigger device"
        )
    return num_params


# ---- tokenizer and model -------------------------------------------------------------------------------------


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are bytes, then EOS and PAD. Needs no download."""

    eos_token_id = 256
    pad_token_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer behind the same small interface (needs it cached or internet)."""

    def __init__(self, name: str) -> None:
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(name)
        except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors... for a missing tokenizer
            raise ConfigError(
                f"data.tokenizer: cannot load {name!r} ({type(exc).__name__}); offline, use data.tokenizer=bytes"
            ) from None
        self.eos_token_id = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = self.eos_token_id if pad is None else pad
        self.vocab_size = len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


def make_tokenizer(name: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)


def build_model(config: ModelConfig, vocab_size: int, *, seed: int, dtype: Any = None) -> Any:
    """A randomly initialized causal LM (identical on every peer for the same seed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = config.vocab_size or vocab_size
    if vocab < vocab_size:
        raise ConfigError(f"model.vocab_size ({vocab}) is smaller than the tokenizer's ({vocab_size}); use 0")
    config_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM) if config.arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    )
    hf_config = config_cls(
        vocab_size=vocab,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_embeddings,
    )
    torch.manual_seed(seed)
    model = model_cls(hf_config)
    return model if dtype is None else model.to(dtype)


# ---- metrics ----------------------------------------------------------------------------------------------


class MetricsLog:
    """JSON lines (``output_dir/metrics.jsonl``) from the main process, and TensorBoard scalars if installed.

    Every line has ``event``: ``step`` (step-level loss), ``round`` (PulseLoCo's per-round metrics, the fields
    of :class:`pulseloco.loco.RoundMetrics`), ``eval``, ``publish``, ``rollout`` or ``done``; and ``time``.
    """

    def __init__(self, output_dir: Path, *, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.writer: Any = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(output_dir / "tb"))
            except ImportError:
                logger.info("tensorboard is not installed; writing JSON lines only")

    def write(self, event: str, step: int | None = None, **values: Any) -> None:
        if not self.enabled:
            return
        record = {"event": event, "time": round(time.time(), 3), **({"step": step} if step is not None else {})}
        record.update(values)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        if self.writer is not None and step is not None:
            for name, value in values.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{event}/{name}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a metrics file, in order."""
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# ---- strategies -----------------------------------------------------------------------------------------------


class DataParallel:
    """``ddp``: the inner optimizer steps every process's DDP-wrapped model; there are no outer rounds.

    ``bytes_per_step`` estimates what a ring all-reduce of the FP32 gradients sends per process per step,
    ``2 (W - 1) / W * 4 * numel``, for comparison with the swarm strategies' measured bytes.
    """

    name = "ddp"

    def __init__(self, accelerator: Any, model: Any, inner_optimizer: Any) -> None:
        self.inner_optimizer = inner_optimizer
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        world = accelerator.num_processes
        self.bytes_per_step = int(2 * (world - 1) / world * 4 * numel)
        self.round: int | None = None
        self.local_step = 0

    def step(self, loss: float) -> Any:
        self.inner_optimizer.step()
        return None

    def zero_grad(self) -> None:
        self.inner_optimizer.zero_grad(set_to_none=True)

    @property
    def at_round_boundary(self) -> bool:
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": self.name, "inner_optimizer": self.inner_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])

    def close(self) -> None:
        pass


class SwarmPeer:
    """``diloco`` / ``pulseloco`` / ``sparseloco``: :class:`pulseloco.PulseLoCo` over the inner optimizer."""

    def __init__(self, accelerator: Any, model: Any, inner_optimizer: Any, options: SwarmOptions, dht: Any) -> None:
        from pulseloco import PulseLoCo

        self.name = options.strategy
        self.loco = PulseLoCo(
            model,
            inner_optimizer,
            dht=dht,
            run_id=options.run_id,
            inner_steps=options.inner_steps,
            outer_lr=options.outer_lr,
            outer_momentum=options.outer_momentum,
            selector=str(options.selector),
            topk_density=options.topk_density,
            topk_chunk_size=options.topk_chunk_size,
            matchmaking_time=options.matchmaking_time,
            target_group_size=options.target_group_size,
            averaging_timeout=options.averaging_timeout,
            request_timeout=options.request_timeout,
        )

    @property
    def round(self) -> int:
        return self.loco.round

    @property
    def at_round_boundary(self) -> bool:
        return self.loco.local_step == 0

    def step(self, loss: float) -> Any:
        """One inner step; returns the round's metrics when this step ended an outer round (main process)."""
        round_before = self.loco.round
        self.loco.step(loss=loss)
        if self.loco.local_step == 0 and (self.loco.round != round_before or self.loco.last_metrics is not None):
            return self.loco.last_metrics
        return None

    def zero_grad(self) -> None:
        self.loco.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": self.name, "pulseloco": self.loco.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loco.load_state_dict(state["pulseloco"])

    def close(self) -> None:
        self.loco.shutdown()


def join_swarm(accelerator: Any, options: SwarmOptions) -> Any:
    """Start this peer's DHT on the main process; every process raises the same :class:`ConfigError` on failure.

    Prints the peer's multiaddrs, which others pass to ``--initial-peers``.
    """
    from pulseloco.swarm import SwarmConfig, make_dht

    dht, error = None, None
    if accelerator.is_main_process:
        try:
            dht = make_dht(
                SwarmConfig(
                    initial_peers=options.initial_peers,
                    host_maddrs=options.host_maddrs,
                    announce_maddrs=options.announce_maddrs,
                    identity_path=options.identity,
                    client_mode=options.client_mode,
                    startup_timeout=options.startup_timeout,
                    swarm_key_path=options.swarm_key,
                )
            )
        except PulseLocoError as exc:
            error = str(exc)
    if accelerator.num_processes > 1:
        import torch.distributed

        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(error)
    if dht is not None:
        print(f"swarm: strategy={options.strategy} run_id={options.run_id} peer_id={dht.peer_id}", flush=True)
        for maddr in dht.get_visible_maddrs():
            print(f"swarm: multiaddr {maddr}", flush=True)
    return dht


def peer_salt(options: SwarmOptions, dht: Any) -> int:
    """Salt of this peer's data order: ``peer_index`` if given, else derived from the peer id (0 under ddp)."""
    if options.peer_index is not None:
        return options.peer_index
    if dht is None:
        return 0
    return zlib.crc32(str(dht.peer_id).encode()) & 0x7FFFFFFF


def setup_strategy(
    accelerator: Any, model: Any, inner_optimizer: Any, options: SwarmOptions, dht: Any = None
) -> tuple[DataParallel | SwarmPeer, int]:
    """(strategy, data salt). ``model`` is the unwrapped model whose parameters the optimizer steps; ``dht``
    comes from :func:`join_swarm` (needed by the swarm strategies, ignored by ``ddp``)."""
    if options.selector is None:
        return DataParallel(accelerator, model, inner_optimizer), 0
    peer = SwarmPeer(accelerator, model, inner_optimizer, options, dht)
    salt = peer_salt(options, dht)
    if accelerator.num_processes > 1:
        import torch.distributed

        box = [salt]
        torch.distributed.broadcast_object_list(box, src=0)
        salt = int(box[0])
    return peer, salt


def leave_swarm(dht: Any, linger: float, *closers: Callable[[], Any]) -> None:
    """Stay ``linger`` seconds (slower peers may still fetch shards, state or versions from us), run ``closers``
    (strategy, publisher), then stop the DHT."""
    if dht is not None and linger > 0:
        time.sleep(linger)
    for close in closers:
        close()
    if dht is not None:
        dht.shutdown()


def round_record(metrics: Any) -> dict[str, Any]:
    """The JSON fields of a :class:`pulseloco.loco.RoundMetrics`."""
    return dataclasses.asdict(metrics)


def check_steps_fit_rounds(options: SwarmOptions, total_steps: int, what: str) -> None:
    """Swarm strategies end on an outer-round boundary (the last rounds would be cut otherwise)."""
    if options.selector is not None and total_steps % options.inner_steps:
        raise ConfigError(
            f"{what} ({total_steps}) must be a multiple of swarm.inner_steps ({options.inner_steps}) "
            f"for strategy {options.strategy}"
        )


# ---- checkpoints ---------------------------------------------------------------------------------------------


def checkpoint_path(train: TrainConfig) -> Path:
    return Path(train.output_dir) / "checkpoint.pt"


def save_checkpoint(
    accelerator: Any, train: TrainConfig, *, step: int, model: Any, strategy: Any, **extra: Any
) -> None:
    """Write ``output_dir/checkpoint.pt`` atomically from the main process (between outer rounds)."""
    import torch

    if not accelerator.is_main_process:
        return
    path = checkpoint_path(train)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": accelerator.unwrap_model(model).state_dict(),
        "strategy": strategy.state_dict(),
        "extra": extra,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(train: TrainConfig, strategy_name: str) -> dict[str, Any] | None:
    """The checkpoint to resume from (None without ``--resume``); :class:`ConfigError` if it cannot be used."""
    import torch

    if not train.resume:
        return None
    path = checkpoint_path(train)
    if not path.exists():
        raise ConfigError(f"--resume: no checkpoint at {path} (check --output-dir)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch.load raises many types for a damaged file
        raise ConfigError(f"--resume: cannot read {path}: {exc}") from None
    written_with = state.get("strategy", {}).get("strategy")
    if written_with != strategy_name:
        raise ConfigError(
            f"--resume: {path} was written with strategy {written_with}; resume with --strategy {written_with} "
            "or start a new --output-dir"
        )
    return state


def restore(accelerator: Any, state: dict[str, Any], *, model: Any, strategy: Any) -> int:
    """Load a checkpoint into the model and strategy; returns the inner step to continue from."""
    accelerator.unwrap_model(model).load_state_dict(state["model"])
    strategy.load_state_dict(state["strategy"])
    return int(state["step"])


def progress(accelerator: Any, *, total: int, initial: int, desc: str) -> Any:
    """tqdm on the main process only."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=not accelerator.is_main_process, dynamic_ncols=True)


def make_accelerator(train: TrainConfig) -> Any:
    import torch
    from accelerate import Accelerator

    if train.num_threads:
        torch.set_num_threads(train.num_threads)
    # accelerate treats several processes on a machine without CUDA as multi-CPU (gloo) only when told so;
    # `accelerate launch --multi_gpu --num_processes N` then works on CPU as well.
    cpu_only = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(mixed_precision=train.mixed_precision, cpu=cpu_only)
