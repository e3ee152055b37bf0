"""Causal-LM training of a Llama/Qwen2 model built from a config, with ddp, diloco, pulseloco or sparseloco.

    accelerate launch recipes/pretrain.py --config recipes/configs/tiny.yaml --strategy pulseloco
    accelerate launch --num_processes 2 recipes/pretrain.py --strategy ddp --steps 32
    accelerate launch recipes/pretrain.py --strategy diloco --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...

Data: ``--data.paths`` (text or .jsonl files, or directories), else ``--data.dataset`` (a ``datasets`` name, needs
internet), else the Python standard library's sources (on every machine). Byte-level tokenizer by default.
Writes ``output_dir/metrics.jsonl`` (step loss, per-round PulseLoCo metrics, held-out loss) and
``output_dir/checkpoint.pt`` (``--resume`` continues from it).
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
from common import ConfigError, DataConfig, RecipeConfig

SECTIONS = ("model", "train", "swarm", "data", "pretrain")
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".tex", ".html", ".c", ".h"}


# ---- data -----------------------------------------------------------------------------------------------------


def default_corpus_files() -> list[Path]:
    """The Python standard library's .py files (sources and docstrings): text that exists on any machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def _files_under(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"data.paths: {name} does not exist")
    if not files:
        raise ConfigError(f"data.paths: no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under {paths}")
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
            raise ConfigError(f"data.paths: {path}:{number} is not JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ConfigError(f"data.paths: {path}:{number} has no string field {text_field!r} (data.text_field)")
        yield record[text_field]


def _texts_from_dataset(data: DataConfig) -> Iterator[str]:
    try:
        import datasets  # optional: only for --data.dataset
    except ImportError:
        raise ConfigError("data.dataset needs the datasets package (pip install datasets)") from None
    try:
        rows = datasets.load_dataset(str(data.dataset), split=data.dataset_split, streaming=True)
    except Exception as exc:  # no internet, unknown name, ...: datasets raises many types
        raise ConfigError(f"data.dataset: cannot load {data.dataset!r} ({type(exc).__name__}: {exc})") from None
    for row in rows:
        text = row.get(data.text_field)
        if not isinstance(text, str):
            raise ConfigError(f"data.dataset: rows have no string field {data.text_field!r} (data.text_field)")
        yield text


def load_texts(data: DataConfig) -> list[str]:
    """Documents, up to ``data.max_bytes`` of text in total."""
    if data.paths:
        source: Iterator[str] = (t for f in _files_under(data.paths) for t in _texts_from_file(f, data.text_field))
    elif data.dataset:
        source = _texts_from_dataset(data)
    else:
        source = (f.read_text(encoding="utf-8", errors="replace") for f in default_corpus_files())
    texts, total = [], 0
    for text in source:
        if not text:
            continue
        texts.append(text[: data.max_bytes - total])
        total += len(texts[-1])
        if total >= data.max_bytes:
            break
    return texts


class TokenWindows:
    """Random windows of ``seq_len`` tokens from one token stream; a batch is a pure function of its seed."""

    def __init__(self, tokens_T: Any, batch_size: int, seq_len: int) -> None:
        self.tokens_T = tokens_T
        self.batch_size = batch_size
        self.seq_len = seq_len

    def batch(self, seed: int) -> Any:
        import torch

        gen = torch.Generator().manual_seed(seed)
        starts_B = torch.randint(0, len(self.tokens_T) - self.seq_len, (self.batch_size,), generator=gen)
        return torch.stack([self.tokens_T[s : s + self.seq_len] for s in starts_B.tolist()])


def get_dataloaders(config: RecipeConfig, tokenizer: Any) -> tuple[TokenWindows, TokenWindows]:
    """(train, held-out) windows over the tokenized corpus; the held-out part is the stream's tail."""
    import torch

    texts = load_texts(config.data)
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text)
        ids.append(tokenizer.eos_token_id)
    tokens_T = torch.tensor(ids, dtype=torch.long)
    num_eval = int(len(tokens_T) * config.data.eval_fraction)
    seq_len = config.pretrain.seq_len
    if num_eval <= seq_len or len(tokens_T) - num_eval <= seq_len:
        raise ConfigError(
            f"the corpus has only {len(tokens_T)} tokens: too few for pretrain.seq_len={seq_len} "
            "(add data.paths or raise data.max_bytes)"
        )
    train = TokenWindows(tokens_T[:-num_eval], config.pretrain.batch_size, seq_len)
    held_out = TokenWindows(tokens_T[-num_eval:], config.pretrain.batch_size, seq_len)
    return train, held_out


def batch_seed(seed: int, salt: int, process_index: int, step: int) -> int:
    """Seed of one process's batch at one step: different per peer and process, reproducible on resume."""
    return (seed * 1_000_003 + salt * 7_919 + process_index * 104_729 + step) % (2**63 - 1)


# ---- training --------------------------------------------------------------------------------------------------


def evaluate(accelerator: Any, model: Any, held_out: TokenWindows, num_batches: int) -> float:
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(num_batches):
            tokens = held_out.batch(10_000_019 + i).to(accelerator.device)
            with accelerator.autocast():
                losses.append(float(model(input_ids=tokens, labels=tokens).loss))
    model.train()
    return sum(losses) / len(losses)


def training_function(config: RecipeConfig) -> None:
    import torch

    cfg, swarm = config.pretrain, config.swarm
    common.check_steps_fit_rounds(swarm, cfg.steps, "pretrain.steps")
    if cfg.seq_len > config.model.max_position_embeddings:
        raise ConfigError(
            f"pretrain.seq_len ({cfg.seq_len}) exceeds model.max_position_embeddings "
            f"({config.model.max_position_embeddings})"
        )
    accelerator = common.make_accelerator(config.train)
    tokenizer = common.make_tokenizer(config.data.tokenizer)
    num_params = common.check_model_fits(
        config.model,
        tokenizer.vocab_size,
        swarm=swarm.selector is not None,
        num_local_processes=accelerator.num_processes,
        device=accelerator.device,
    )
    train_data, held_out = get_dataloaders(config, tokenizer)
    model = common.build_model(config.model, tokenizer.vocab_size, seed=config.train.seed)
    inner_optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model = accelerator.prepare(model)  # DDP across this launch's processes
    dht = common.join_swarm(accelerator, swarm) if swarm.selector is not None else None
    strategy, salt = common.setup_strategy(accelerator, accelerator.unwrap_model(model), inner_optimizer, swarm, dht)
    checkpoint = common.load_checkpoint(config.train, strategy.name)
    start = common.restore(accelerator, checkpoint, model=model, strategy=strategy) if checkpoint else 0
    output_dir = Path(config.train.output_dir)
    metrics = common.MetricsLog(output_dir, enabled=accelerator.is_main_process, tensorboard=config.train.tensorboard)
    accelerator.print(
        f"pretrain: {num_params / 1e6:.2f}M parameters, strategy={strategy.name}, "
        f"processes={accelerator.num_processes}, steps {start}->{cfg.steps}, output_dir={output_dir}"
    )
    metrics.write("start", step=start, strategy=strategy.name, num_params=num_params, config=config.to_dict())
    bytes_sent_total = 0
    every = config.train.checkpoint_every
    next_checkpoint = (start // every + 1) * every if every else 0
    bar = common.progress(accelerator, total=cfg.steps, initial=start, desc=f"pretrain[{strategy.name}]")
    started = time.monotonic()
    model.train()
    for step in range(start, cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
        for group in inner_optimizer.param_groups:
            group["lr"] = lr
        tokens = train_data.batch(batch_seed(config.train.seed, salt, accelerator.process_index, step))
        tokens = tokens.to(accelerator.device)
        with accelerator.autocast():
            loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        if cfg.grad_clip:
            accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        loss_value = float(loss.detach())
        round_metrics = strategy.step(loss_value)
        strategy.zero_grad()
        done = step + 1
        if isinstance(strategy, common.DataParallel):
            bytes_sent_total += strategy.bytes_per_step
        elif round_metrics is not None:
            bytes_sent_total += round_metrics.bytes_sent
            metrics.write("round", step=done, **common.round_record(round_metrics))
        if done % config.train.log_every == 0 or done == cfg.steps:
            metrics.write(
                "step",
                step=done,
                loss=loss_value,
                lr=lr,
                round=strategy.round,
                bytes_sent_total=bytes_sent_total,
                seconds=time.monotonic() - started,
            )
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
            metrics.write("eval", step=done, loss=evaluate(accelerator, model, held_out, cfg.eval_batches))
        if next_checkpoint and done >= next_checkpoint and strategy.at_round_boundary and done != cfg.steps:
            common.save_checkpoint(accelerator, config.train, step=done, model=model, strategy=strategy)
            next_checkpoint = (done // every + 1) * every
        bar.set_postfix(loss=f"{loss_value:.3f}", round=strategy.round)
        bar.update(1)
    bar.close()
    eval_loss = evaluate(accelerator, model, held_out, cfg.eval_batches)
    metrics.write("eval", step=cfg.steps, loss=eval_loss)
    common.save_checkpoint(accelerator, config.train, step=cfg.steps, model=model, strategy=strategy)
    seconds = time.monotonic() - started
    metrics.write("done", step=cfg.steps, eval_loss=eval_loss, bytes_sent_total=bytes_sent_total, seconds=seconds)
    accelerator.print(
        f"pretrain: done step={cfg.steps} eval_loss={eval_loss:.4f} bytes_sent={bytes_sent_total} "
        f"seconds={seconds:.1f} metrics={metrics.path}"
    )
    metrics.close()
    accelerator.wait_for_everyone()
    common.leave_swarm(dht, swarm.linger, strategy.close)
    accelerator.end_training()


def main(argv: list[str] | None = None) -> None:
    config = common.load_config(argv, prog="pretrain.py", description=__doc__.split("\n")[0], sections=SECTIONS)
    common.setup_logging(config.train)
    training_function(config)


if __name__ == "__main__":
    common.run_recipe("pretrain.py", lambda: main(sys.argv[1:]))
