"""A rollout worker: follows the GRPO trainers' published versions (PULSESync) and scores samples with them.

    python recipes/rollout_worker.py --config recipes/configs/tiny.yaml \\
        --initial-peers MADDR_OF_A_TRAINER --public-key keys/publisher.pub [--until-version N]

It holds the policy in BF16, exactly as published: every version arrives as a sparse signed patch (or a
squashed patch, or an anchor plus patches after a gap) and is verified by state digest before use. For each
new version it prints and logs (``output_dir/metrics.jsonl``, event ``rollout``) the greedy exact-match reward on
``rollout.num_prompts`` fixed problems and the digest of the weights it holds, which equals the digest the
publisher announced (and logged as event ``publish``).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import common
from common import ConfigError, RecipeConfig

SECTIONS = ("model", "train", "swarm", "grpo", "rollout")


def worker_function(config: RecipeConfig) -> None:
    import signal

    import torch
    from grpo import make_problems, policy_run_id, score_policy

    from pulseloco.errors import PatchError
    from pulseloco.sync.signing import load_public_key
    from pulseloco.sync.subscriber import Subscriber

    rollout, swarm = config.rollout, config.swarm
    if not rollout.public_key:
        raise ConfigError("--public-key is required: the publisher's .pub file (from `pulseloco keygen`)")
    if not swarm.initial_peers:
        raise ConfigError("--initial-peers is required: the multiaddr printed by a trainer or `pulseloco dht`")
    public_key = load_public_key(rollout.public_key)
    accelerator = common.make_accelerator(config.train)
    tokenizer = common.make_tokenizer("bytes")
    model = common.build_model(config.model, tokenizer.vocab_size, seed=config.train.seed, dtype=torch.bfloat16)
    model = model.to(accelerator.device).eval()
    dht = common.join_swarm(accelerator, swarm)
    subscriber = Subscriber(dht, policy_run_id(swarm.run_id), public_key, timeout=rollout.update_timeout)
    metrics = common.MetricsLog(
        Path(config.train.output_dir), enabled=accelerator.is_main_process, tensorboard=config.train.tensorboard
    )
    problems = make_problems(random.Random(12345), rollout.num_prompts, config.grpo)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    deadline = time.monotonic() + rollout.max_seconds if rollout.max_seconds else None
    print(f"rollout: following run_id={policy_run_id(swarm.run_id)}", flush=True)
    try:
        while not stop.is_set():
            try:
                report = subscriber.update_report(model)
            except PatchError as exc:  # keeps the last complete version; the next check retries
                print(f"rollout: update failed, retrying: {exc}", flush=True)
                report = None
            if report is not None:
                with subscriber.lock:
                    reward = score_policy(model, tokenizer, problems, config.grpo.max_new_tokens)
                print(
                    f"rollout: version={report.version} reward={reward:.3f} digest={report.digest} "
                    f"changed={report.num_changed} bytes={report.bytes_received} path={report.path}",
                    flush=True,
                )
                metrics.write(
                    "rollout",
                    step=report.version,
                    version=report.version,
                    reward=reward,
                    digest=report.digest,
                    num_changed=report.num_changed,
                    bytes_received=report.bytes_received,
                    seconds_update=report.seconds,
                    path=report.path,
                )
                if rollout.until_version is not None and report.version >= rollout.until_version:
                    break
            if deadline is not None and time.monotonic() > deadline:
                if rollout.until_version is not None:
                    raise ConfigError(
                        f"version {rollout.until_version} did not arrive within rollout.max_seconds="
                        f"{rollout.max_seconds:g} (holding version {subscriber.version}); check --initial-peers "
                        "and that a trainer runs with --publish"
                    )
                break
            stop.wait(rollout.interval)
    finally:
        metrics.close()
        subscriber.close()
        dht.shutdown()


def main(argv: list[str] | None = None) -> None:
    config = common.load_config(argv, prog="rollout_worker.py", description=__doc__.split("\n")[0], sections=SECTIONS)
    common.setup_logging(config.train)
    worker_function(config)


if __name__ == "__main__":
    common.run_recipe("rollout_worker.py", lambda: main(sys.argv[1:]))
