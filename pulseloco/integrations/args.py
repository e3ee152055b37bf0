"""The pulseloco options of a training script, as one dataclass for ``TrlParser`` / ``HfArgumentParser``.

    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig, PulseLoCoArguments))
    script_args, training_args, model_args, pulse_args = parser.parse_args_and_config()
    trainer = GRPOTrainer(..., callbacks=pulse_args.callbacks(output_dir=training_args.output_dir))

Every field is a command-line flag (``--strategy pulseloco``, ``--initial_peers MADDR``, ``--inner_steps 8``) and a
key of the YAML ``--config`` file. Invalid values raise :class:`pulseloco.errors.ConfigError` naming the field,
when the parser builds the dataclass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pulseloco.errors import ConfigError
from pulseloco.keys import policy_run_id
from pulseloco.loco.placement import OUTER_STATE_DEVICES
from pulseloco.loco.selection import VALUE_DTYPES, SelectorName

if TYPE_CHECKING:
    from pulseloco.integrations.swarm_rollouts import Fallback

STRATEGIES: dict[str, SelectorName | None] = {
    "ddp": None,
    "diloco": "dense",
    "pulseloco": "pulse",
    "sparseloco": "topk",
}
"""Strategy -> PulseLoCo selector; ``ddp`` (``None``) is the Trainer's own data parallelism, no swarm."""


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


@dataclass(kw_only=True)
class SwarmArguments:
    """How a process joins the swarm (trainers and rollout workers alike)."""

    run_id: str = field(
        default="pulseloco",
        metadata=_help("Peers with the same run_id average together; rollout workers follow `<run_id>.policy`."),
    )
    initial_peers: list[str] = field(
        default_factory=list,
        metadata=_help("Multiaddrs of peers in the swarm (printed by `pulseloco dht` or a peer); none: a new swarm."),
    )
    host_maddrs: list[str] = field(
        default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"],
        metadata=_help("Addresses to listen on (/ip4/0.0.0.0/tcp/PORT for a publicly reachable peer)."),
    )
    announce_maddrs: list[str] = field(
        default_factory=list, metadata=_help("Addresses others should dial (a public address behind forwarding).")
    )
    client_mode: bool = field(
        default=False,
        metadata=_help(
            "Behind NAT: connect out only (needs initial_peers); by default reachable through a relay slot on a "
            "public initial peer (see --use_auto_relay), else it serves nothing."
        ),
    )
    use_auto_relay: bool | None = field(
        default=None,
        metadata=_help(
            "Reserve a slot on a relay (the initial peers, or --relays) and be reachable through it, so that a "
            "peer behind NAT can own shards and relay weights to rollout workers. Default: on with --client_mode "
            "when a relay has a public address; --use_auto_relay false turns it off."
        )
        | {"nargs": "?", "const": True},  # a bare --use_auto_relay means true, as for the other bool flags
    )
    relays: list[str] = field(
        default_factory=list,
        metadata=_help("Relays to reserve a slot on (multiaddrs with /p2p/ID); none: the initial peers."),
    )
    use_relay: bool = field(
        default=True,
        metadata=_help("Allow relayed connections and serve as a relay (--use_relay false turns both off)."),
    )
    identity: str | None = field(
        default=None, metadata=_help("Identity file that keeps the peer id and multiaddr across restarts.")
    )
    swarm_key: str | None = field(
        default=None, metadata=_help("Swarm key file: only its holders write DHT records the others accept.")
    )
    startup_timeout: float = field(default=30.0, metadata=_help("Seconds to start the DHT and reach a peer."))

    def __post_init__(self) -> None:
        if not self.run_id or any(c.isspace() for c in self.run_id) or len(self.run_id) > 100:
            raise ConfigError(f"run_id must be 1-100 characters without spaces, got {self.run_id!r}")
        if not (self.startup_timeout > 0 and math.isfinite(self.startup_timeout)):
            raise ConfigError(f"startup_timeout must be a positive number, got {self.startup_timeout}")

    @property
    def policy_run_id(self) -> str:
        """The PULSESync run that rollout workers follow."""
        return policy_run_id(self.run_id)

    def swarm_config(self) -> Any:
        """The :class:`pulseloco.swarm.SwarmConfig` of these options (raises :class:`ConfigError` for a bad
        multiaddr)."""
        from pulseloco.swarm import SwarmConfig

        return SwarmConfig(
            initial_peers=self.initial_peers,
            host_maddrs=self.host_maddrs,
            announce_maddrs=self.announce_maddrs,
            identity_path=self.identity,
            client_mode=self.client_mode,
            use_relay=self.use_relay,
            use_auto_relay=self.use_auto_relay,
            relays=self.relays,
            startup_timeout=self.startup_timeout,
            swarm_key_path=self.swarm_key,
        )


@dataclass(kw_only=True)
class PulseLoCoArguments(SwarmArguments):
    """How this training run averages with its swarm and publishes versions to rollout workers."""

    strategy: str = field(
        default="pulseloco",
        metadata=_help(
            "ddp: the Trainer's own data parallelism across the processes of one `accelerate launch`, no swarm. "
            "diloco / pulseloco / sparseloco: this launch is one swarm peer averaging every inner_steps optimizer "
            "steps with the dense / pulse / topk selector."
        ),
    )
    inner_steps: int = field(default=8, metadata=_help("H: optimizer steps per outer round."))
    outer_lr: float = field(default=0.7, metadata=_help("Nesterov outer learning rate."))
    outer_momentum: float = field(default=0.9, metadata=_help("Nesterov outer momentum, in [0, 1)."))
    topk_density: float = field(default=0.01, metadata=_help("sparseloco: fraction of each chunk sent."))
    topk_chunk_size: int = field(default=4096, metadata=_help("sparseloco: chunk size of the top-k selection."))
    pulse_values: str = field(
        default="float32",
        metadata=_help(
            "pulseloco: precision of the values sent, float32 (the paper) or bfloat16 (2 bytes a value; the "
            "rounding remainder stays in the residual and is sent later)."
        ),
    )
    outer_state_device: str = field(
        default="auto",
        metadata=_help(
            "Where PulseLoCo keeps theta, the residual and the outer momentum (12 bytes a parameter): auto / cpu: "
            "pinned host memory for a model on a GPU; model: on the model's GPU (faster rounds, needs the room)."
        ),
    )
    target_group_size: int | None = field(
        default=None,
        metadata=_help("Start a round as soon as this many peers registered (1: train alone without waiting)."),
    )
    matchmaking_time: float = field(default=15.0, metadata=_help("Seconds to gather peers for a round."))
    averaging_timeout: float = field(default=60.0, metadata=_help("Seconds a round's exchange may take."))
    request_timeout: float = field(default=10.0, metadata=_help("Seconds for one DHT operation or message."))
    linger: float = field(
        default=5.0,
        metadata=_help("Seconds to stay in the swarm after training, so that slower peers and workers finish."),
    )
    publish: bool = field(
        default=False, metadata=_help("Publish every outer round's weights to rollout workers with PULSESync.")
    )
    signing_key: str | None = field(
        default=None, metadata=_help("The publisher's private key (`pulseloco keygen --out PATH`); with --publish.")
    )
    store_dir: str | None = field(
        default=None, metadata=_help("Version store of the publisher; default: <output_dir>/versions.")
    )
    anchor_every: int = field(default=10, metadata=_help("A full BF16 anchor every this many versions."))
    publish_every: int = field(
        default=0,
        metadata=_help("Publish every N optimizer steps instead of every outer round (needed with --strategy ddp)."),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy: unknown strategy {self.strategy!r} (choose from {', '.join(STRATEGIES)})")
        for name in ("inner_steps", "topk_chunk_size", "anchor_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("outer_lr", "matchmaking_time", "averaging_timeout", "request_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number, got {value}")
        if not (self.linger >= 0 and math.isfinite(self.linger)):
            raise ConfigError(f"linger must be >= 0 seconds, got {self.linger}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not 0 < self.topk_density <= 1:
            raise ConfigError(f"topk_density must be in (0, 1], got {self.topk_density}")
        if self.pulse_values not in VALUE_DTYPES:
            raise ConfigError(f"pulse_values must be one of {', '.join(VALUE_DTYPES)}, got {self.pulse_values!r}")
        if self.pulse_values != "float32" and self.strategy != "pulseloco":
            raise ConfigError(f"pulse_values={self.pulse_values} needs --strategy pulseloco, got {self.strategy}")
        if self.outer_state_device not in OUTER_STATE_DEVICES:
            raise ConfigError(
                f"outer_state_device must be one of {', '.join(OUTER_STATE_DEVICES)}, got {self.outer_state_device!r}"
            )
        if self.target_group_size is not None and self.target_group_size < 1:
            raise ConfigError(f"target_group_size must be at least 1, got {self.target_group_size}")
        if self.publish_every < 0:
            raise ConfigError(f"publish_every must be >= 0, got {self.publish_every}")
        if self.publish and not self.signing_key:
            raise ConfigError("--publish needs --signing_key PATH (make one with `pulseloco keygen --out PATH`)")
        if self.publish and self.selector is None and not self.publish_every:
            raise ConfigError("--publish with --strategy ddp has no outer rounds: set --publish_every N (steps)")

    @property
    def selector(self) -> SelectorName | None:
        """The PulseLoCo selector of the strategy (``None`` for ``ddp``)."""
        return STRATEGIES[self.strategy]

    def callbacks(self, *, output_dir: str | Path | None = None, max_steps: int | None = None) -> list[Any]:
        """The Trainer callbacks of these options: a :class:`PulseLoCoCallback` for swarm strategies and a
        :class:`PulseSyncCallback` with ``--publish``; none for plain ``ddp``. Round metrics go to
        ``<output_dir>/pulseloco_rounds.jsonl`` and published versions to ``<output_dir>/pulsesync_versions.jsonl``
        when ``output_dir`` is given. With ``max_steps`` (the Trainer's), a swarm strategy checks at once that the
        run ends on an outer-round boundary (the callback checks again when training starts); raises
        :class:`ConfigError` naming the flags."""
        from pulseloco.integrations.pulsesync import PulseSyncCallback
        from pulseloco.integrations.trainer import PulseLoCoCallback, check_round_boundary

        if self.selector is not None and max_steps is not None:
            try:
                check_round_boundary(max_steps, self.inner_steps)
            except ConfigError as exc:
                raise ConfigError(f"--strategy {self.strategy}: {exc} (set --max_steps or --inner_steps)") from None

        out = Path(output_dir) if output_dir is not None else None
        callbacks: list[Any] = []
        loco = None
        if self.selector is not None:
            loco = PulseLoCoCallback(
                swarm=self.swarm_config(),
                run_id=self.run_id,
                inner_steps=self.inner_steps,
                selector=self.selector,
                outer_lr=self.outer_lr,
                outer_momentum=self.outer_momentum,
                topk_density=self.topk_density,
                topk_chunk_size=self.topk_chunk_size,
                pulse_values=self.pulse_values,
                outer_state_device=self.outer_state_device,
                matchmaking_time=self.matchmaking_time,
                target_group_size=self.target_group_size,
                averaging_timeout=self.averaging_timeout,
                request_timeout=self.request_timeout,
                linger=self.linger,
                metrics_path=None if out is None else out / "pulseloco_rounds.jsonl",
            )
            callbacks.append(loco)
        if self.publish:
            store = Path(self.store_dir) if self.store_dir else (out or Path(".")) / "versions"
            callbacks.append(
                PulseSyncCallback(
                    signing_key=self.signing_key,
                    run_id=self.policy_run_id,
                    store_dir=store,
                    anchor_every=self.anchor_every,
                    every=self.publish_every or "round",
                    swarm=None if loco is not None else self.swarm_config(),
                    linger=self.linger,
                    metrics_path=None if out is None else out / "pulsesync_versions.jsonl",
                )
            )
        return callbacks


ROLLOUT_SOURCES = ("local", "swarm")


@dataclass(kw_only=True)
class RolloutArguments:
    """Where a GRPO trainer's completions come from: its own model (TRL's generation) or the swarm's rollout
    workers (:class:`pulseloco.integrations.swarm_rollouts.SwarmRollouts`, TRL's ``rollout_func``)."""

    rollouts: str = field(
        default="local",
        metadata=_help(
            "local: the trainer generates its completions itself. swarm: rollout workers that follow this run's "
            "versions generate them (recipes/rollout_worker.py --serve_rollouts)."
        ),
    )
    rollout_fallback: str = field(
        default="local",
        metadata=_help("With --rollouts swarm and no usable worker for --rollout_timeout s: local (generate) or wait."),
    )
    max_lag: int = field(
        default=2, metadata=_help("A completion made with version v is trained on only up to version v + max_lag.")
    )
    lease_timeout: float = field(
        default=60.0, metadata=_help("Seconds a worker has for one lease; then it goes to another worker.")
    )
    rollout_timeout: float = field(
        default=60.0, metadata=_help("Seconds without any usable rollout worker before --rollout_fallback.")
    )
    rollout_lookahead: bool = field(
        default=True, metadata=_help("Send the next batch to the workers while the trainer trains on this one.")
    )
    public_key: str | None = field(
        default=None,
        metadata=_help(
            "The publisher's public key (.pub of `pulseloco keygen`); with --rollouts swarm on a trainer that does "
            "not --publish itself."
        ),
    )
    verify_rollouts: bool = field(
        default=True,
        metadata=_help(
            "Check the workers' completions with this trainer's model before training on them: each token must be "
            "the replayable sampler's choice and each log-probability near the trainer's (--no_verify_rollouts: "
            "trust the workers)."
        ),
    )
    verify_margin: float = field(
        default=2.0,
        metadata=_help(
            "Nats (of logits / temperature plus noise, per version of lag plus one) by which a worker's token may "
            "trail the sampler's choice without counting as a mismatch: covers engine and device differences."
        ),
    )
    verify_max_mismatch_rate: float = field(
        default=0.0, metadata=_help("Fraction of a completion's positions that may mismatch before its lease fails.")
    )
    verify_max_logprob_error: float = field(
        default=0.25,
        metadata=_help(
            "Mean |worker - trainer| log-probability per token (per version of lag plus one) a lease may have."
        ),
    )
    verify_fraction: float = field(
        default=1.0,
        metadata=_help(
            "Fraction of each lease's completions checked, drawn at random (at least one): the check's forward pass "
            "shrinks with it, and a worker cheating on few completions is caught less surely."
        ),
    )
    max_refusals: int = field(
        default=3,
        metadata=_help("Failed leases (bad replies or failed checks) before a worker is refused for the run."),
    )

    def __post_init__(self) -> None:
        if self.rollouts not in ROLLOUT_SOURCES:
            raise ConfigError(f"rollouts must be one of {', '.join(ROLLOUT_SOURCES)}, got {self.rollouts!r}")
        from pulseloco.integrations.swarm_rollouts import FALLBACKS

        if self.rollout_fallback not in FALLBACKS:
            raise ConfigError(f"rollout_fallback must be one of {', '.join(FALLBACKS)}, got {self.rollout_fallback!r}")
        if self.max_lag < 0:
            raise ConfigError(f"max_lag must be >= 0, got {self.max_lag}")
        for name in ("lease_timeout", "rollout_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if not (self.verify_margin >= 0 and math.isfinite(self.verify_margin)):
            raise ConfigError(f"verify_margin must be a finite number >= 0, got {self.verify_margin}")
        if not 0 <= self.verify_max_mismatch_rate < 1:
            raise ConfigError(f"verify_max_mismatch_rate must be in [0, 1), got {self.verify_max_mismatch_rate}")
        if not (self.verify_max_logprob_error > 0 and math.isfinite(self.verify_max_logprob_error)):
            raise ConfigError(f"verify_max_logprob_error must be positive, got {self.verify_max_logprob_error}")
        if not 0 < self.verify_fraction <= 1:
            raise ConfigError(f"verify_fraction must be in (0, 1], got {self.verify_fraction}")
        if self.max_refusals < 1:
            raise ConfigError(f"max_refusals must be at least 1, got {self.max_refusals}")

    def rollout_func(self, pulse_args: PulseLoCoArguments, *, output_dir: str | Path | None = None) -> Any:
        """The ``rollout_func`` for TRL's ``GRPOTrainer``: a :class:`SwarmRollouts` with ``--rollouts swarm``, else
        None (TRL generates). It joins the swarm of ``pulse_args`` (the DHT of the PulseLoCo or PulseSync callback
        when there is one) and writes ``<output_dir>/rollouts.jsonl``. Raises :class:`ConfigError` when neither
        ``--public_key`` nor ``--publish`` says which versions exist."""
        if self.rollouts == "local":
            return None
        from pulseloco.integrations.swarm_rollouts import SwarmRollouts
        from pulseloco.integrations.verify import RolloutVerifier

        if not self.public_key and not pulse_args.publish:
            raise ConfigError(
                "--rollouts swarm needs --public_key PATH (the publisher's .pub file), or --publish on this trainer"
            )
        return SwarmRollouts(
            swarm=pulse_args.swarm_config(),
            run_id=pulse_args.run_id,
            public_key=self.public_key,
            max_lag=self.max_lag,
            lease_timeout=self.lease_timeout,
            rollout_timeout=self.rollout_timeout,
            fallback=cast("Fallback", self.rollout_fallback),  # one of FALLBACKS: checked in __post_init__
            lookahead=self.rollout_lookahead,
            verify=self.verify_rollouts,
            verifier=RolloutVerifier(
                margin=self.verify_margin,
                max_mismatch_rate=self.verify_max_mismatch_rate,
                max_logprob_error=self.verify_max_logprob_error,
                fraction=self.verify_fraction,
            ),
            max_refusals=self.max_refusals,
            metrics_path=None if output_dir is None else Path(output_dir) / "rollouts.jsonl",
        )
