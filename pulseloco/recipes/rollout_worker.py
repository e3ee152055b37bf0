"""A rollout worker: follows the GRPO trainers' published versions (PULSESync), generates and scores with them.

    python recipes/rollout_worker.py --model_name_or_path WARM_MODEL_DIR --run_id tiny \\
        --initial_peers MADDR_OF_A_TRAINER --public_key keys/publisher.pub --output_dir runs/worker [--until_version N]

``model_name_or_path`` is the policy's starting checkpoint (the trainers' ``--model_name_or_path``): it gives the
tokenizer and the tensor names and shapes; the weights then come from the publisher, held in BF16 exactly as
published. Every version arrives as a signed sparse patch (or a squashed patch, or an anchor plus patches after
a gap) and is verified by state digest before use. For each new version the worker prints one line and appends
one JSON line to ``<output_dir>/rollouts.jsonl``: version, greedy exact-match reward on the held-out problems,
changed elements, bytes received, seconds the update took, seconds from the publisher signing the version to
this worker serving it (``seconds_to_serve``; the two clocks must agree), the engine's weight version, digest (equal
to the one the publisher logged), path. A worker serving leases also appends one line per lease to
``<output_dir>/leases.jsonl``: when it arrived, waited for its version, generated and finished, and with which
version (:attr:`pulseloco.rollouts.worker.RolloutServer.on_lease`).

``--engine vllm`` generates with vLLM (:class:`pulseloco.rollouts.engines.vllm.VLLMEngine`, the ``pulseloco[vllm]``
extra): the subscriber patches the engine's BF16 state in checkpoint coordinates, then only what changed is
loaded into the running engine. ``--compare_full_reload`` also times loading every tensor into the same engine
for each version (``seconds_full_reload``), the baseline that a full-checkpoint push would need at the least.
``--engine transformers`` generates with the ``transformers`` model itself.

``--serve_rollouts`` makes the worker generate the trainers' GRPO completions (``recipes/grpo.py --rollouts swarm``):
it announces itself in the DHT with the version it serves and its throughput, answers the trainers' leases with
token ids, sampling log-probabilities and the version (with the publisher's signed envelope of it) it generated
with (:class:`pulseloco.rollouts.worker.RolloutServer`), downloads the next version while it generates, and does
not score the versions itself. ``--full_checkpoints`` fetches a full BF16 copy of every version instead of patches
(the baseline; the publisher runs with ``--anchor_every 1``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pulseloco.integrations.args import PublicKeyArguments
from pulseloco.recipes import common, tasks

PROG = "rollout_worker.py"
ENGINES = ("transformers", "vllm")


@dataclass(kw_only=True)
class WorkerArguments(PublicKeyArguments, tasks.TaskArguments):
    """What the worker loads, whom it trusts, and how long it runs; the task it scores versions on."""

    _argument_group_name: ClassVar[str] = "rollout worker"

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The policy's starting checkpoint (the trainers' --model_name_or_path)."}
    )
    engine: str = field(default="transformers", metadata={"help": f"Generation engine: {', '.join(ENGINES)}."})
    compute_dtype: str = field(
        default="auto",
        metadata={
            "help": "The engine's compute dtype on the same published BF16 weights: bfloat16, float32, or auto "
            "(float32 for the transformers engine on a CPU, 4.7x faster there than BF16 for the demo model; "
            "else bfloat16)."
        },
    )
    compare_full_reload: bool = field(
        default=False, metadata={"help": "vLLM: also time a reload of every tensor per version (the baseline)."}
    )
    output_dir: str = field(default="runs/worker", metadata={"help": "rollouts.jsonl goes here."})
    num_prompts: int = field(default=64, metadata={"help": "Held-out prompts scored greedily per version."})
    max_new_tokens: int = field(default=6, metadata={"help": "Longest completion."})
    interval: float = field(default=1.0, metadata={"help": "Seconds between checks for a new version."})
    until_version: int | None = field(default=None, metadata={"help": "Exit once this version is reached."})
    max_seconds: float = field(default=0.0, metadata={"help": "Exit after this many seconds; 0: no limit."})
    update_timeout: float = field(default=60.0, metadata={"help": "Seconds one update may take."})
    wait_warning: float = field(
        default=60.0, metadata={"help": "Say what the worker waits for when no version arrived after this long."}
    )
    serve_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Generate the trainers' rollouts: announce this worker in the DHT and answer their leases "
            "(trainers run recipes/grpo.py --rollouts swarm). Versions are then not scored."
        },
    )
    lease_max_new_tokens: int = field(
        default=512, metadata={"help": "With --serve_rollouts: the longest completion a lease may ask for."}
    )
    full_checkpoints: bool = field(
        default=False,
        metadata={
            "help": "The baseline of an ordinary weight push: fetch a full BF16 copy of every version instead of "
            "patches (the publisher must run with --anchor_every 1)."
        },
    )
    max_queue: int = field(
        default=8, metadata={"help": "With --serve_rollouts: leases waiting at once; more are answered busy."}
    )

    @property
    def model_path(self) -> str:
        """``--model_name_or_path``; raises :class:`ConfigError` when it was not given."""
        if not self.model_name_or_path:
            raise common.ConfigError("--model_name_or_path is required: the trainers' starting checkpoint")
        return self.model_name_or_path

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.compute_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"compute_dtype must be auto, bfloat16 or float32, got {self.compute_dtype!r}")
        if self.compare_full_reload and self.engine != "vllm":
            raise ValueError("--compare_full_reload needs --engine vllm")
        for name in ("num_prompts", "max_new_tokens", "lease_max_new_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("interval", "update_timeout", "wait_warning"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def _load_engine(args: WorkerArguments) -> tuple[Any, Any]:
    """``(engine, the vLLM engine or None)`` for ``--engine``; raises what loading the checkpoint raises."""
    from pulseloco.rollouts.engines.hf import TransformersEngine

    dtype = args.compute_dtype
    if dtype == "auto":  # the transformers engine runs on the CPU, where FP32 is the faster
        dtype = "bfloat16" if args.engine == "vllm" else "float32"
    if args.engine == "vllm":
        from pulseloco.rollouts.engines.vllm import VLLMEngine

        engine = VLLMEngine.from_pretrained(args.model_path, dtype=dtype)
        print(f"rollout: vLLM engine loaded in {engine.load_seconds:.1f} s", flush=True)
        return engine, engine
    import torch

    return TransformersEngine.from_pretrained(args.model_path, dtype=getattr(torch, dtype)), None


def _serve_leases(args: WorkerArguments, run_id: str, dht: Any, engine: Any, subscriber: Any) -> Any:
    """A :class:`~pulseloco.rollouts.worker.RolloutServer` answering the trainers' leases (``--serve_rollouts``),
    else None."""
    if not args.serve_rollouts:
        return None
    from transformers import AutoConfig

    from pulseloco.rollouts.worker import RolloutServer

    vocab_size = max(len(engine.tokenizer), int(AutoConfig.from_pretrained(args.model_path).vocab_size))
    server = RolloutServer(
        dht,
        run_id,
        engine,
        subscriber,
        engine_name=args.engine,
        vocab_size=vocab_size,
        max_new_tokens=args.lease_max_new_tokens,
        max_queue=args.max_queue,
    )
    print(f"rollout: serving leases peer_id={server.peer_id}", flush=True)
    return server


class _Follower:
    """What the worker does with each version the subscriber applied: load it into the engine, serve it (or score
    it on the held-out problems), and write one record to ``rollouts.jsonl`` and one line to stdout."""

    def __init__(
        self, args: WorkerArguments, swarm: Any, engine: Any, vllm_engine: Any, subscriber: Any, server: Any
    ) -> None:
        from pulseloco.jsonl import JsonLinesWriter

        self.args, self.swarm, self.engine, self.vllm_engine = args, swarm, engine, vllm_engine
        self.subscriber, self.server = subscriber, server
        output = Path(args.output_dir)
        output.mkdir(parents=True, exist_ok=True)
        (output / "rollouts.jsonl").unlink(missing_ok=True)  # one run per directory: no records of an earlier run
        self.log = JsonLinesWriter(output / "rollouts.jsonl")
        if server is not None:
            (output / "leases.jsonl").unlink(missing_ok=True)
            server.on_lease = JsonLinesWriter(output / "leases.jsonl").write
        spec = tasks.spec_for_model(args.model_path, args.task, args.max_operand)
        self.problems = tasks.eval_problems(spec, args.num_prompts)
        self.started = time.monotonic()
        self.warned = False

    def on_update(self, report: Any) -> None:
        args, engine, server = self.args, self.engine, self.server
        loaded = time.perf_counter()
        engine.weights_updated(report.changed, version=report.version)
        seconds_load = time.perf_counter() - loaded
        if server is not None:
            server.weights_loaded(report.version, report.digest)
        seconds_to_serve = time.time() - report.published if report.published else None
        full_reload = self.vllm_engine.reload_all() if self.vllm_engine and args.compare_full_reload else None
        reward = None
        if server is None:  # a serving worker spends its time on the trainers' leases
            with self.subscriber.lock:
                completions = engine.generate([p for p, _ in self.problems], max_new_tokens=args.max_new_tokens)
            reward = tasks.score(completions, self.problems)
        record = {
            "version": report.version,
            "reward": reward,
            "digest": report.digest,
            "num_changed": report.num_changed,
            "bytes_received": report.bytes_received,
            "seconds_update": round(report.seconds, 4),
            "seconds_load": round(seconds_load, 4),
            "seconds_to_serve": round(seconds_to_serve, 4) if seconds_to_serve is not None else None,
            "seconds_full_reload": round(full_reload, 4) if full_reload is not None else None,
            "engine": args.engine,
            "path": report.path,
            "time": round(time.time(), 3),
        }
        scored = f" reward={reward:.3f}" if reward is not None else ""
        if server is not None:
            record.update(leases_served=server.num_served, tokens_per_s=round(server.tokens_per_s, 2))
            scored += f" leases_served={server.num_served}"
        self.log.write(record)
        serve = f" to_serve={seconds_to_serve:.3f}s" if seconds_to_serve is not None else ""
        print(
            f"rollout: version={report.version}{scored} digest={report.digest} "
            f"changed={report.num_changed} bytes={report.bytes_received} path={report.path} "
            f"load={seconds_load:.3f}s{serve}",
            flush=True,
        )

    def on_idle(self) -> None:
        waited = time.monotonic() - self.started
        if self.subscriber.version is None and not self.warned and waited > self.args.wait_warning:
            self.warned = True
            run = self.swarm.run_id
            print(
                f"rollout: no version of run_id={self.swarm.policy_run_id} after {self.args.wait_warning:.0f} s; "
                f"check that a trainer in the swarm of --initial_peers publishes run {run} signed by the key of "
                f"--public_key: a recipe with --publish --run_id {run}, or a script with "
                f'PulseSyncCallback(signing_key=..., run_id="{run}") (or the run id of its PulseLoCoCallback or '
                "SwarmRollouts)",
                flush=True,
            )


def parse_arguments(argv: list[str] | None) -> tuple[WorkerArguments, Any]:
    """The worker's options (``WorkerArguments``, ``SwarmArguments``) from ``argv``, with the ones it cannot run
    without (``--model_name_or_path``, ``--public_key``, ``--initial_peers``) present. Raises :class:`ConfigError`
    (one line; exit code 2 from the command line) for a bad, unknown or missing option."""
    from pulseloco.integrations.args import SwarmArguments

    args, swarm = common.parse_args((WorkerArguments, SwarmArguments), argv, PROG)
    args.model_path  # noqa: B018  # raises ConfigError when missing
    if not args.public_key:
        raise common.ConfigError("--public_key is required: the publisher's .pub file (from `pulseloco keygen`)")
    if not swarm.initial_peers:
        raise common.ConfigError("--initial_peers is required: the multiaddr printed by a trainer or `pulseloco dht`")
    return args, swarm


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` and follow the trainers' versions until interrupted, ``--until_version`` or
    ``--max_seconds``. Raises :class:`ConfigError` for bad or missing options (:func:`parse_arguments`) and
    :class:`~pulseloco.errors.VersionTimeoutError` when ``--until_version`` did not arrive in time; the DHT, the
    subscriber, the lease server and a vLLM engine are closed on every way out."""
    args, swarm = parse_arguments(argv)

    from pulseloco.errors import VersionTimeoutError
    from pulseloco.signals import stop_on_signals
    from pulseloco.swarm import make_dht
    from pulseloco.sync.signing import load_public_key
    from pulseloco.sync.subscriber import Subscriber

    public_key = load_public_key(str(args.public_key))  # present: parse_arguments checked
    engine, vllm_engine = _load_engine(args)
    dht = make_dht(swarm.swarm_config())
    subscriber = Subscriber(
        dht,
        swarm.policy_run_id,
        public_key,
        timeout=args.update_timeout,
        full_checkpoints=args.full_checkpoints,
        no_head_warning_after=float("inf"),  # the worker says it once, in its own terms (_Follower.on_idle)
    )
    server = None
    try:
        server = _serve_leases(args, swarm.policy_run_id, dht, engine, subscriber)
        follower = _Follower(args, swarm, engine, vllm_engine, subscriber, server)
        stop = stop_on_signals()
        print(f"rollout: following run_id={swarm.policy_run_id} engine={args.engine}", flush=True)
        reached = subscriber.run(
            engine.weights(),
            follower.on_update,
            interval=args.interval,
            stop=stop,
            until_version=args.until_version,
            max_seconds=args.max_seconds or None,
            on_idle=follower.on_idle,
        )
        if args.until_version is not None and not reached and not stop.is_set():
            raise VersionTimeoutError(
                f"version {args.until_version} did not arrive within --max_seconds {args.max_seconds:g} "
                f"(holding version {subscriber.version}); check --initial_peers and that a trainer publishes run "
                f"{swarm.run_id} (a recipe with --publish --run_id {swarm.run_id}, a script with PulseSyncCallback)"
            )
    finally:
        if server is not None:
            server.close()
        subscriber.close()
        dht.shutdown()
        if vllm_engine is not None:
            vllm_engine.close()


def run() -> None:
    """The command line (``python recipes/rollout_worker.py ...``): :func:`main` on ``sys.argv``; exits 2 on a bad
    configuration and 1 on a run-time failure, with one line (:func:`common.run_recipe`)."""
    common.run_recipe(PROG, lambda: main(sys.argv[1:]))


if __name__ == "__main__":
    run()
