"""Causal-LM pretraining with transformers' ``Trainer``: ddp, or a diloco / pulseloco / sparseloco swarm peer.

    accelerate launch --config_file recipes/accelerate_configs/single_process.yaml \\
        recipes/pretrain.py --config recipes/configs/pretrain-tiny.yaml
    accelerate launch --config_file recipes/accelerate_configs/multi_process_cpu.yaml \\
        recipes/pretrain.py --config recipes/configs/pretrain-tiny.yaml --strategy ddp
    accelerate launch recipes/pretrain.py --config recipes/configs/pretrain-tiny.yaml \\
        --model_name_or_path ~/.cache/pulseloco/models/warm-tiny-... --max_steps 32

Configuration is four dataclasses read by ``trl.TrlParser``: :class:`ModelArguments`, :class:`DataArguments`,
``transformers.TrainingArguments`` and ``PulseLoCoArguments`` (``--strategy`` and the swarm options). A flat YAML
file (``--config FILE``) sets any of their fields; flags on the command line override it; ``--help`` lists them.

Model: ``--model_name_or_path`` (a Hugging Face checkpoint: a local directory or a hub name) continues training a
pretrained model; otherwise a model is built with random weights from ``--model_config`` (a config.json or a
directory holding one) or from the size fields (``--hidden_size`` ...). The tokenizer is the model's, or
``--tokenizer_name_or_path``; ``bytes`` (the default without a model) is a byte-level tokenizer made here, with
no download.

Data: ``--data_paths`` (text or .jsonl files, or directories), else ``--dataset_name`` (a ``datasets`` name; needs
internet), else the Python standard library's sources, which exist on every machine. The text is tokenized into
one stream and cut into ``seq_len`` blocks; the last ``eval_fraction`` of them is held out.

The output directory receives a Hugging Face checkpoint (model and tokenizer, ``from_pretrained`` loads it), so a
model pretrained here is a ``model_name_or_path`` for ``recipes/grpo.py``. The configs report to TensorBoard
(``report_to: tensorboard``): event files in ``<output_dir>/tensorboard`` with the loss and, for a swarm peer,
``pulseloco/*`` per outer round; ``tensorboard --logdir <output_dir>`` shows them.
"""

from __future__ import annotations

import array
import json
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pulseloco.errors import ConfigError
from pulseloco.recipes import common

PROG = "pretrain.py"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".tex", ".html", ".c", ".h"}
BYTE_TOKENIZER = "bytes"
"""``tokenizer_name_or_path`` value of the byte-level tokenizer built by :func:`byte_level_tokenizer`."""
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
ARCHS = ("llama", "qwen2")


# ---- configuration ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ModelArguments:
    """Which model to train: a pretrained checkpoint, a config to build, or a size to build."""

    _argument_group_name: ClassVar[str] = "model"

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "a Hugging Face causal-LM checkpoint (local directory or hub name) to continue training"},
    )
    model_config: str | None = field(
        default=None,
        metadata={"help": "a config.json (or a directory with one) to build a randomly initialized model from"},
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "tokenizer (directory or hub name); default: the model's, or 'bytes' without a model"},
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "dtype of the weights: float32 (use --bf16 for mixed precision), bfloat16 or auto"},
    )
    arch: str = field(default="llama", metadata={"help": "architecture built from the size fields: llama or qwen2"})
    hidden_size: int = field(default=64, metadata={"help": "size field: width"})
    intermediate_size: int = field(default=192, metadata={"help": "size field: MLP width"})
    num_hidden_layers: int = field(default=2, metadata={"help": "size field: layers"})
    num_attention_heads: int = field(default=4, metadata={"help": "size field: query heads"})
    num_key_value_heads: int = field(default=2, metadata={"help": "size field: key/value heads (GQA)"})
    max_position_embeddings: int = field(default=256, metadata={"help": "size field: longest sequence"})
    tie_word_embeddings: bool = field(default=True, metadata={"help": "size field: share input/output embeddings"})

    def __post_init__(self) -> None:
        if self.model_name_or_path and self.model_config:
            raise ConfigError("model_name_or_path and model_config exclude each other: give one")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ConfigError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if self.arch not in ARCHS:
            raise ConfigError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )


@dataclass(kw_only=True)
class DataArguments:
    """Where the text comes from and how it is cut into training blocks."""

    _argument_group_name: ClassVar[str] = "data"

    data_paths: list[str] = field(
        default_factory=list, metadata={"help": "text or .jsonl files, or directories of them (default: stdlib)"}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "a `datasets` dataset name (needs internet)"})
    dataset_split: str = field(default="train", metadata={"help": "split of dataset_name"})
    text_field: str = field(default="text", metadata={"help": "field holding the text in .jsonl rows and datasets"})
    max_bytes: int = field(default=1_000_000, metadata={"help": "read at most this many characters of text"})
    seq_len: int = field(default=128, metadata={"help": "tokens per training block"})
    eval_fraction: float = field(default=0.01, metadata={"help": "fraction of the blocks held out for evaluation"})

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ConfigError(f"max_bytes must be positive, got {self.max_bytes}")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be at least 2, got {self.seq_len}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")


# ---- tokenizer -------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which the ByteLevel pre-tokenizer and decoder use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {byte: chr(code) for byte, code in chars.items()}


def byte_level_tokenizer(model_max_length: int | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per byte (id = byte value), then ``<|endoftext|>`` and a pad.

    A BPE model without merges over the byte-level alphabet: any text round-trips exactly, nothing is
    downloaded, and ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` work as for any hub tokenizer. No BOS
    token and no chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    kwargs = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, **kwargs)


def load_tokenizer(model_args: ModelArguments) -> Any:
    """The tokenizer named by ``tokenizer_name_or_path``, else the model's, else the byte-level one."""
    from pulseloco import models

    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path or BYTE_TOKENIZER
    if name == BYTE_TOKENIZER:
        return byte_level_tokenizer(model_args.max_position_embeddings)
    tokenizer = models.load_tokenizer(name)
    if tokenizer.eos_token is None:
        raise ConfigError(f"the tokenizer of {name!r} has no eos token")
    return tokenizer


# ---- model -----------------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _torch_dtype(name: str) -> Any:
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def model_config_from_sizes(model_args: ModelArguments, tokenizer: Any) -> Any:
    """A LlamaConfig or Qwen2Config from the size fields, with the tokenizer's vocabulary and special tokens."""
    from transformers import LlamaConfig, Qwen2Config

    config_cls = LlamaConfig if model_args.arch == "llama" else Qwen2Config
    return config_cls(
        vocab_size=len(tokenizer),
        hidden_size=model_args.hidden_size,
        intermediate_size=model_args.intermediate_size,
        num_hidden_layers=model_args.num_hidden_layers,
        num_attention_heads=model_args.num_attention_heads,
        num_key_value_heads=model_args.num_key_value_heads,
        max_position_embeddings=model_args.max_position_embeddings,
        tie_word_embeddings=model_args.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _check_fits(config: Any, bytes_per_parameter: float, device: Any) -> None:
    """Refuse (one line) a model that would not fit in the free memory of ``device``, before building it."""
    from pulseloco import models

    try:
        num_params = models.count_parameters(config)
    except ValueError as exc:  # not a causal LM config
        raise ConfigError(f"model_config: not a causal language model ({_first_line(exc)[:200]})") from None
    processes_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if str(device).startswith("cpu") else 1
    needed = num_params * bytes_per_parameter * processes_here
    available = models.available_memory_bytes(device)
    if available is not None and needed > available:
        raise ConfigError(
            f"the model does not fit: {num_params / 1e6:.1f}M parameters need about {needed / 2**30:.1f} GiB "
            f"({bytes_per_parameter:g} bytes each x {processes_here} process(es)) but {available / 2**30:.1f} GiB "
            f"is free on {device}; make it smaller (hidden_size, num_hidden_layers) or use a bigger device"
        )


def build_model(
    model_args: ModelArguments,
    tokenizer: Any,
    *,
    seed: int,
    bytes_per_parameter: float = 16,
    device: Any = "cpu",
) -> Any:
    """The causal LM to train: loaded from ``model_name_or_path`` or built (seeded) from a config or sizes.

    A checkpoint is checked first (exists, is a causal LM, fits: ``bytes_per_parameter`` per parameter on
    ``device``), so that a mistake ends with one line before any weights are read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    dtype = _torch_dtype(model_args.dtype)
    if model_args.model_name_or_path:
        from pulseloco import models

        model = models.load_causal_lm(
            model_args.model_name_or_path,
            dtype=dtype,
            bytes_per_parameter=bytes_per_parameter,
            num_local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            device=device,
        )
    else:
        if model_args.model_config:
            path = Path(model_args.model_config).expanduser()
            if not path.exists():
                raise ConfigError(f"model_config: {path} does not exist")
            try:
                config = AutoConfig.from_pretrained(str(path))
            except Exception as exc:  # OSError, ValueError, JSON errors
                raise ConfigError(
                    f"model_config: cannot read {path} ({type(exc).__name__}: {_first_line(exc)})"
                ) from None
        else:
            config = model_config_from_sizes(model_args, tokenizer)
        _check_fits(config, bytes_per_parameter, device)
        set_seed(seed)  # identical initial weights on every process and peer
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=None if dtype == "auto" else dtype)
        except ValueError as exc:
            raise ConfigError(f"model_config: not a causal language model ({_first_line(exc)[:200]})") from None
    vocab_size = model.get_input_embeddings().weight.shape[0]
    if vocab_size < len(tokenizer):
        raise ConfigError(
            f"the model's vocabulary ({vocab_size}) is smaller than the tokenizer's ({len(tokenizer)}): "
            "use the model's own tokenizer"
        )
    return model


def max_sequence_length(model: Any) -> int | None:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


# ---- data ------------------------------------------------------------------------------------------------------


def default_corpus_files() -> list[Path]:
    """The Python standard library's .py files (sources and docstrings): text that exists on any machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def _files_under(paths: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for name in paths:
        path = Path(name).expanduser()
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"data_paths: {name} does not exist")
    if not files:
        raise ConfigError(f"data_paths: no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under {list(paths)}")
    return files


def _texts_from_file(path: Path, text_field: str) -> Iterator[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".jsonl":
        yield text
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"data_paths: {path}:{number} is not JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ConfigError(f"data_paths: {path}:{number} has no string field {text_field!r} (text_field)")
        yield record[text_field]


def _texts_from_dataset(data_args: DataArguments) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise ConfigError("dataset_name needs the datasets package (pip install datasets)") from None
    try:
        rows = datasets.load_dataset(str(data_args.dataset_name), split=data_args.dataset_split, streaming=True)
    except Exception as exc:  # no internet, unknown name, ...: datasets raises many types
        raise ConfigError(
            f"dataset_name: cannot load {data_args.dataset_name!r} ({type(exc).__name__}: {_first_line(exc)})"
        ) from None
    for row in rows:
        text = row.get(data_args.text_field)
        if not isinstance(text, str):
            raise ConfigError(f"dataset_name: rows have no string field {data_args.text_field!r} (text_field)")
        yield text


def load_texts(data_args: DataArguments) -> list[str]:
    """Documents, up to ``max_bytes`` characters in total."""
    if data_args.data_paths:
        files = _files_under(data_args.data_paths)
        source: Iterator[str] = (t for f in files for t in _texts_from_file(f, data_args.text_field))
    elif data_args.dataset_name:
        source = _texts_from_dataset(data_args)
    else:
        source = (f.read_text(encoding="utf-8", errors="replace") for f in default_corpus_files())
    texts: list[str] = []
    total = 0
    for text in source:
        if not text:
            continue
        texts.append(text[: data_args.max_bytes - total])
        total += len(texts[-1])
        if total >= data_args.max_bytes:
            break
    return texts


def token_blocks(texts: Sequence[str], tokenizer: Any, seq_len: int) -> Any:
    """The texts as one token stream (an eos after each document) cut into ``seq_len`` blocks; the rest is dropped.

    Returns an int64 array of shape (num_blocks, seq_len). The stream is held as 4-byte ints, not a Python list
    (about 30 bytes per token), so that hundreds of millions of tokens fit.
    """
    import numpy as np

    stream = array.array("i")
    for start in range(0, len(texts), 1000):  # bounded batches: a hub tokenizer's encodings are large
        for ids in tokenizer(list(texts[start : start + 1000]), add_special_tokens=False, verbose=False)["input_ids"]:
            stream.extend(ids)
            stream.append(tokenizer.eos_token_id)
    num_blocks = len(stream) // seq_len
    return np.frombuffer(stream, dtype=np.int32)[: num_blocks * seq_len].reshape(num_blocks, seq_len).astype(np.int64)


def get_datasets(data_args: DataArguments, tokenizer: Any) -> tuple[Any, Any | None]:
    """(train, held-out) ``datasets.Dataset`` of ``input_ids`` blocks; held-out is the stream's tail (or None)."""
    from datasets import Dataset

    blocks = token_blocks(load_texts(data_args), tokenizer, data_args.seq_len)
    num_eval = int(len(blocks) * data_args.eval_fraction)
    if data_args.eval_fraction > 0:
        num_eval = max(num_eval, 1)
    if len(blocks) - num_eval < 1:
        raise ConfigError(
            f"the corpus has only {len(blocks)} blocks of seq_len={data_args.seq_len} tokens: too few "
            "(add data_paths, raise max_bytes or lower seq_len)"
        )
    train = Dataset.from_dict({"input_ids": blocks[: len(blocks) - num_eval]})
    held_out = Dataset.from_dict({"input_ids": blocks[len(blocks) - num_eval :]}) if num_eval else None
    return train, held_out


def collate_blocks(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Equal-length blocks -> ``input_ids`` and ``labels`` (the model shifts them); no padding, nothing masked."""
    import torch

    input_ids = torch.tensor([row["input_ids"] for row in rows], dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


# ---- training --------------------------------------------------------------------------------------------------


def make_trainer(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: Any,
    *,
    callbacks: Sequence[Any] = (),
    tokenizer: Any = None,
    swarm: bool = False,
) -> Any:
    """A ``transformers.Trainer`` for causal-LM training on the configured model and data (not yet trained).

    ``swarm``: this process is a swarm peer (PulseLoCo keeps three more FP32 copies of the parameters), which
    the memory check counts. TensorBoard's event files (``report_to``) go to ``<output_dir>/tensorboard``
    (:func:`common.tensorboard_logging_dir`).
    """
    from transformers import Trainer

    from pulseloco.models import TRAINING_BYTES_PER_PARAMETER

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_args)
    model = build_model(
        model_args,
        tokenizer,
        seed=training_args.seed,
        bytes_per_parameter=TRAINING_BYTES_PER_PARAMETER if swarm else 16,
        device=training_args.device,
    )
    longest = max_sequence_length(model)
    if longest is not None and data_args.seq_len > longest:
        raise ConfigError(f"seq_len ({data_args.seq_len}) exceeds the model's max_position_embeddings ({longest})")
    train, held_out = get_datasets(data_args, tokenizer)
    with common.tensorboard_logging_dir(training_args.output_dir):
        return Trainer(
            model=model,
            args=training_args,
            train_dataset=train,
            eval_dataset=held_out,
            data_collator=collate_blocks,
            processing_class=tokenizer,
            callbacks=list(callbacks),
        )


def _resume_arg(value: str | None) -> str | bool | None:
    """``resume_from_checkpoint``: a checkpoint directory, or ``true`` / ``last`` for the newest in output_dir."""
    if value is None or value.lower() in ("", "false", "no"):
        return None
    return True if value.lower() in ("true", "yes", "last") else value


def training_function(
    model_args: ModelArguments, data_args: DataArguments, training_args: Any, pulse_args: Any
) -> None:
    # none for ddp (the Trainer's own); swarm strategies end on an outer-round boundary
    callbacks = pulse_args.callbacks(output_dir=training_args.output_dir, max_steps=training_args.max_steps)
    swarm = pulse_args.selector is not None
    trainer = make_trainer(model_args, data_args, training_args, callbacks=callbacks, swarm=swarm)
    model = trainer.model
    num_params = sum(p.numel() for p in model.parameters())
    if trainer.is_world_process_zero():
        print(
            f"{PROG}: {num_params / 1e6:.2f}M parameters, {len(trainer.train_dataset)} blocks of "
            f"{data_args.seq_len} tokens, processes={training_args.world_size}, max_steps={training_args.max_steps}, "
            f"output_dir={training_args.output_dir}",
            flush=True,
        )
    result = trainer.train(resume_from_checkpoint=_resume_arg(training_args.resume_from_checkpoint))
    metrics = dict(result.metrics)
    if trainer.eval_dataset is not None:
        metrics.update(trainer.evaluate())
    trainer.log_metrics("all", metrics)
    trainer.save_metrics("all", metrics)
    trainer.save_state()
    trainer.save_model()  # model and tokenizer (processing_class), Hugging Face format
    if trainer.is_world_process_zero():
        eval_loss = metrics.get("eval_loss")
        print(
            f"{PROG}: done steps={trainer.state.global_step} train_loss={metrics.get('train_loss', float('nan')):.4f} "
            + (f"eval_loss={eval_loss:.4f} " if eval_loss is not None else "")
            + f"saved={training_args.output_dir}",
            flush=True,
        )


# ---- command line ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    import torch
    from transformers import TrainingArguments

    from pulseloco.integrations.args import PulseLoCoArguments

    # Several processes of one `accelerate launch` on a machine without CUDA: the Trainer uses gloo only when told
    # to run on the CPU (`--multi_gpu` on a CPU machine would otherwise look for NCCL).
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    model_args, data_args, training_args, pulse_args = common.parse_args(
        (ModelArguments, DataArguments, TrainingArguments, PulseLoCoArguments), argv, PROG
    )
    common.check_output_dir(training_args.output_dir, training_args.resume_from_checkpoint)
    training_function(model_args, data_args, training_args, pulse_args)


def run() -> None:
    """The command line (``accelerate launch recipes/pretrain.py ...``): :func:`main` on ``sys.argv``; exits 2 on a
    bad configuration and 1 on a run-time failure, with one line (:func:`common.run_recipe`)."""
    common.run_recipe(PROG, lambda: main(sys.argv[1:]))


if __name__ == "__main__":
    run()
