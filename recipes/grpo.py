"""GRPO on synthetic arithmetic with exact-match rewards; trainers are swarm peers and publish with PULSESync.

    pulseloco keygen --out keys/publisher
    accelerate launch recipes/grpo.py --config recipes/configs/tiny.yaml --strategy pulseloco \\
        --publish --signing-key keys/publisher --output-dir runs/peer0
    accelerate launch recipes/grpo.py --config recipes/configs/tiny.yaml --strategy pulseloco \\
        --initial-peers MADDR_OF_PEER0 --output-dir runs/peer1
    python recipes/rollout_worker.py --config recipes/configs/tiny.yaml --initial-peers MADDR_OF_PEER0 \\
        --public-key keys/publisher.pub

The task: a prompt ``12+7=`` must be completed with ``19`` and the end-of-sequence token (reward 1, else 0).
A short supervised warm-up (``grpo.sft_steps`` at ``grpo.sft_lr``) makes rewards non-zero; then GRPO
(``grpo.steps`` at the RL learning rate ``grpo.lr``): ``group_size`` samples per prompt, advantages normalized
within each group, one on-policy policy-gradient step per batch (no KL term, no clipping needed on-policy).
Every outer round (every ``swarm.inner_steps`` steps under ddp) the consensus weights are published as a new
version with :class:`pulseloco.sync.publisher.Publisher` (``--publish``: peer 0 by default, any trainer may).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

import common
from common import ConfigError, GRPOConfig, RecipeConfig

SECTIONS = ("model", "train", "swarm", "grpo", "publish")


# ---- the task ---------------------------------------------------------------------------------------------------


def make_problems(rng: random.Random, num: int, grpo: GRPOConfig) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: ``a+b=`` -> ``a+b``, or ``a-b=`` -> ``a-b`` with a >= b."""
    problems = []
    for _ in range(num):
        a, b = rng.randint(0, grpo.max_operand), rng.randint(0, grpo.max_operand)
        if grpo.task == "add":
            problems.append((f"{a}+{b}=", str(a + b)))
        else:
            a, b = max(a, b), min(a, b)
            problems.append((f"{a}-{b}=", str(a - b)))
    return problems


def reward(completion: str, answer: str) -> float:
    """Exact match of the text before the end-of-sequence token."""
    return 1.0 if completion == answer else 0.0


def problem_seed(seed: int, salt: int, process_index: int, step: int) -> int:
    return (seed * 1_000_003 + salt * 7_919 + process_index * 104_729 + step) % (2**63 - 1)


def _left_pad(tokenizer: Any, prompts: list[str], device: Any) -> tuple[Any, Any]:
    import torch

    encoded = [tokenizer.encode(p) for p in prompts]
    width = max(len(e) for e in encoded)
    ids_BP = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    mask_BP = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids_BP[i, width - len(e) :] = torch.tensor(e)
        mask_BP[i, width - len(e) :] = 1
    return ids_BP.to(device), mask_BP.to(device)


def generate(
    model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int, temperature: float | None
) -> tuple[Any, Any, Any, Any, list[str]]:
    """Sample (``temperature``) or decode greedily (``None``) completions.

    Returns (prompt ids, prompt mask, completion ids, completion mask, texts before EOS) with prompts left-padded;
    the completion mask covers the tokens up to and including the first EOS.
    """
    import torch

    device = next(model.parameters()).device
    prompt_BP, prompt_mask_BP = _left_pad(tokenizer, prompts, device)
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt_BP,
            attention_mask=prompt_mask_BP,
            max_new_tokens=max_new_tokens,
            min_new_tokens=1,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
    completion_BC = out[:, prompt_BP.shape[1] :]
    is_eos_BC = completion_BC == tokenizer.eos_token_id
    # Tokens after the first EOS are padding; the EOS itself is part of the completion.
    after_eos_BC = (is_eos_BC.long().cumsum(dim=1) - is_eos_BC.long()) > 0
    completion_mask_BC = (~after_eos_BC).long()
    texts = []
    for row in completion_BC.tolist():
        end = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row)
        texts.append(tokenizer.decode(row[:end]))
    return prompt_BP, prompt_mask_BP, completion_BC, completion_mask_BC, texts


def score_policy(model: Any, tokenizer: Any, problems: list[tuple[str, str]], max_new_tokens: int) -> float:
    """Mean exact-match reward of greedy completions."""
    was_training = model.training
    model.eval()
    *_, texts = generate(model, tokenizer, [p for p, _ in problems], max_new_tokens=max_new_tokens, temperature=None)
    model.train(was_training)
    return sum(reward(t, a) for t, (_, a) in zip(texts, problems)) / len(problems)


# ---- losses -----------------------------------------------------------------------------------------------------


def sft_loss(model: Any, tokenizer: Any, problems: list[tuple[str, str]], device: Any) -> Any:
    """Cross-entropy on the answer and EOS tokens of ``prompt + answer + EOS`` (right-padded)."""
    import torch

    rows = [(tokenizer.encode(p), [*tokenizer.encode(a), tokenizer.eos_token_id]) for p, a in problems]
    width = max(len(p) + len(a) for p, a in rows)
    ids_BT = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels_BT = torch.full((len(rows), width), -100, dtype=torch.long)
    mask_BT = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        ids_BT[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels_BT[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        mask_BT[i, : len(p) + len(a)] = 1
    out = model(input_ids=ids_BT.to(device), attention_mask=mask_BT.to(device), labels=labels_BT.to(device))
    return out.loss


def grpo_loss(
    model: Any, prompt_BP: Any, prompt_mask_BP: Any, completion_BC: Any, completion_mask_BC: Any, advantage_B: Any
) -> Any:
    """On-policy GRPO: ``-mean_b advantage_b * mean_t log p(completion_bt)`` over each completion's tokens."""
    import torch

    ids_BT = torch.cat([prompt_BP, completion_BC], dim=1)
    mask_BT = torch.cat([prompt_mask_BP, completion_mask_BC], dim=1)
    position_ids_BT = (mask_BT.cumsum(dim=1) - 1).clamp(min=0)  # left padding: positions as in generate()
    logits_BTV = model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_ids_BT).logits
    num_prompt = prompt_BP.shape[1]
    logits_BCV = logits_BTV[:, num_prompt - 1 : -1].float()
    logp_BC = torch.log_softmax(logits_BCV, dim=-1).gather(-1, completion_BC.unsqueeze(-1)).squeeze(-1)
    mask_BC = completion_mask_BC.float()
    seq_logp_B = (logp_BC * mask_BC).sum(dim=1) / mask_BC.sum(dim=1).clamp(min=1.0)
    return -(advantage_B * seq_logp_B).mean()


def group_advantages(rewards_B: Any, group_size: int) -> Any:
    """(r - mean of the group) / (std of the group + eps); zero for a group whose rewards are all equal."""
    grouped_NG = rewards_B.view(-1, group_size)
    mean_N1 = grouped_NG.mean(dim=1, keepdim=True)
    std_N1 = grouped_NG.std(dim=1, keepdim=True)
    return ((grouped_NG - mean_N1) / (std_N1 + 1e-4)).reshape(-1)


# ---- publishing ----------------------------------------------------------------------------------------------


def policy_run_id(run_id: str) -> str:
    """The PULSESync run rollout workers follow."""
    return f"{run_id}.policy"


def make_publisher(accelerator: Any, config: RecipeConfig, dht: Any) -> Any:
    """A Publisher on the main process when ``--publish`` (else None)."""
    publish = config.publish
    if not publish.publish:
        return None
    if not publish.signing_key:
        raise ConfigError("--publish needs --signing-key PATH (make one with `pulseloco keygen --out PATH`)")
    from pulseloco.sync.publisher import Publisher
    from pulseloco.sync.signing import load_private_key

    key = load_private_key(publish.signing_key)
    if not accelerator.is_main_process:
        return None
    store = Path(publish.store_dir) if publish.store_dir else Path(config.train.output_dir) / "versions"
    publisher = Publisher(dht, policy_run_id(config.swarm.run_id), key, store, anchor_every=publish.anchor_every)
    accelerator.print(f"publish: run_id={policy_run_id(config.swarm.run_id)} store={store}")
    return publisher


# ---- training ---------------------------------------------------------------------------------------------------


def training_function(config: RecipeConfig) -> None:
    import torch

    grpo, swarm = config.grpo, config.swarm
    total_steps = grpo.sft_steps + grpo.steps
    common.check_steps_fit_rounds(swarm, total_steps, "grpo.sft_steps + grpo.steps")
    common.check_steps_fit_rounds(swarm, grpo.sft_steps, "grpo.sft_steps")
    if len(f"{grpo.max_operand}+{grpo.max_operand}=") + grpo.max_new_tokens > config.model.max_position_embeddings:
        raise ConfigError("model.max_position_embeddings is too small for the prompts plus grpo.max_new_tokens")
    accelerator = common.make_accelerator(config.train)
    tokenizer = common.make_tokenizer("bytes")
    num_params = common.check_model_fits(
        config.model,
        tokenizer.vocab_size,
        swarm=swarm.selector is not None,
        num_local_processes=accelerator.num_processes,
        device=accelerator.device,
    )
    model = common.build_model(config.model, tokenizer.vocab_size, seed=config.train.seed)
    inner_optimizer = torch.optim.AdamW(model.parameters(), lr=grpo.sft_lr, weight_decay=0.0)
    model = accelerator.prepare(model)
    policy = accelerator.unwrap_model(model)
    needs_dht = swarm.selector is not None or config.publish.publish
    dht = common.join_swarm(accelerator, swarm) if needs_dht else None
    publisher = make_publisher(accelerator, config, dht)
    strategy, salt = common.setup_strategy(accelerator, policy, inner_optimizer, swarm, dht)
    checkpoint = common.load_checkpoint(config.train, strategy.name)
    start = common.restore(accelerator, checkpoint, model=model, strategy=strategy) if checkpoint else 0
    output_dir = Path(config.train.output_dir)
    metrics = common.MetricsLog(output_dir, enabled=accelerator.is_main_process, tensorboard=config.train.tensorboard)
    eval_problems = make_problems(random.Random(12345), 64, grpo)
    accelerator.print(
        f"grpo: {num_params / 1e6:.2f}M parameters, strategy={strategy.name}, processes={accelerator.num_processes}, "
        f"steps {start}->{total_steps} (warm-up {grpo.sft_steps}), output_dir={output_dir}"
    )
    metrics.write("start", step=start, strategy=strategy.name, num_params=num_params, config=config.to_dict())
    published = {"version": None}

    def log_published() -> None:
        if publisher is not None and publisher.version != published["version"]:
            published["version"] = publisher.version
            metrics.write("publish", step=None, version=publisher.version, digest=publisher.digest)

    if publisher is not None:
        publisher.publish(policy)
    bytes_sent_total = 0
    bar = common.progress(accelerator, total=total_steps, initial=start, desc=f"grpo[{strategy.name}]")
    started = time.monotonic()
    every = config.train.checkpoint_every
    next_checkpoint = (start // every + 1) * every if every else 0
    model.train()
    for step in range(start, total_steps):
        warmup = step < grpo.sft_steps
        if step == grpo.sft_steps and isinstance(strategy, common.SwarmPeer):
            # The warm-up's outer momentum (pretraining-sized steps) would move every weight for dozens of RL
            # rounds; every peer drops it at this same round boundary.
            strategy.loco.reset_outer_momentum()
        lr = grpo.sft_lr if warmup else grpo.lr
        for group in inner_optimizer.param_groups:
            group["lr"] = lr
        rng = random.Random(problem_seed(config.train.seed, salt, accelerator.process_index, step))
        mean_reward = None
        if warmup:
            loss = sft_loss(model, tokenizer, make_problems(rng, grpo.sft_batch_size, grpo), accelerator.device)
        else:
            problems = make_problems(rng, grpo.prompts_per_step, grpo)
            prompts = [p for p, _ in problems for _ in range(grpo.group_size)]
            answers = [a for _, a in problems for _ in range(grpo.group_size)]
            torch.manual_seed(problem_seed(config.train.seed, salt, accelerator.process_index, step))
            prompt_BP, prompt_mask_BP, completion_BC, completion_mask_BC, texts = generate(
                policy, tokenizer, prompts, max_new_tokens=grpo.max_new_tokens, temperature=grpo.temperature
            )
            rewards_B = torch.tensor([reward(t, a) for t, a in zip(texts, answers)], device=accelerator.device)
            mean_reward = float(rewards_B.mean())
            advantage_B = group_advantages(rewards_B, grpo.group_size)
            with accelerator.autocast():
                loss = grpo_loss(model, prompt_BP, prompt_mask_BP, completion_BC, completion_mask_BC, advantage_B)
        accelerator.backward(loss)
        clip = config.grpo.grad_clip
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), clip)
        loss_value = float(loss.detach())
        round_metrics = strategy.step(loss_value)
        strategy.zero_grad()
        done = step + 1
        if isinstance(strategy, common.DataParallel):
            bytes_sent_total += strategy.bytes_per_step
        elif round_metrics is not None:
            bytes_sent_total += round_metrics.bytes_sent
            metrics.write("round", step=done, **common.round_record(round_metrics))
        if publisher is not None and strategy.at_round_boundary and done % swarm.inner_steps == 0:
            publisher.publish(policy)  # the consensus version: the model was just reset to theta
            log_published()
        if done % config.train.log_every == 0 or done == total_steps:
            metrics.write(
                "step",
                step=done,
                phase="sft" if warmup else "grpo",
                loss=loss_value,
                reward=mean_reward,
                lr=lr,
                round=strategy.round,
                bytes_sent_total=bytes_sent_total,
                seconds=time.monotonic() - started,
            )
        if next_checkpoint and done >= next_checkpoint and strategy.at_round_boundary and done != total_steps:
            common.save_checkpoint(accelerator, config.train, step=done, model=model, strategy=strategy)
            next_checkpoint = (done // every + 1) * every
        bar.set_postfix(phase="sft" if warmup else "grpo", loss=f"{loss_value:.3f}", reward=mean_reward)
        bar.update(1)
    bar.close()
    final_reward = score_policy(policy, tokenizer, eval_problems, grpo.max_new_tokens)
    metrics.write("eval", step=total_steps, reward=final_reward)
    common.save_checkpoint(accelerator, config.train, step=total_steps, model=model, strategy=strategy)
    if publisher is not None:
        try:
            publisher.flush(timeout=120.0)
        except TimeoutError:
            accelerator.print("publish: the last version was still being encoded after 120 s")
        log_published()
        accelerator.print(f"publish: version={publisher.version} digest={publisher.digest}")
    seconds = time.monotonic() - started
    metrics.write("done", step=total_steps, reward=final_reward, bytes_sent_total=bytes_sent_total, seconds=seconds)
    accelerator.print(
        f"grpo: done step={total_steps} greedy_reward={final_reward:.3f} bytes_sent={bytes_sent_total} "
        f"seconds={seconds:.1f} metrics={metrics.path}"
    )
    metrics.close()
    accelerator.wait_for_everyone()
    closers = [strategy.close] + ([publisher.close] if publisher is not None else [])
    common.leave_swarm(dht, swarm.linger, *closers)
    accelerator.end_training()


def main(argv: list[str] | None = None) -> None:
    config = common.load_config(argv, prog="grpo.py", description=__doc__.split("\n")[0], sections=SECTIONS)
    common.setup_logging(config.train)
    training_function(config)


if __name__ == "__main__":
    common.run_recipe("grpo.py", lambda: main(sys.argv[1:]))
