"""The pulseloco options of a training script, as dataclasses for ``TrlParser`` / ``HfArgumentParser``.

    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig, PulseLoCoArguments))
    script_args, training_args, model_args, pulse_args = parser.parse_args_and_config()
    trainer = GRPOTrainer(..., callbacks=pulse_args.callbacks(output_dir=training_args.output_dir))

Every field is a command-line flag (``--strategy pulseloco``, ``--initial_peers MADDR``, ``--inner_steps 8``) and a
key of the YAML ``--config`` file. The fields are those of the library's option dataclasses, which these inherit
(:class:`~pulseloco.swarm.SwarmConfig`, :mod:`pulseloco.loco.config`,
:class:`~pulseloco.integrations.swarm_rollouts.RolloutConfig`, :class:`~pulseloco.rollouts.verify.VerifyConfig`),
so each option is defined, documented and checked once. Invalid values raise :class:`pulseloco.errors.ConfigError`
naming the field, when the parser builds the dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pulseloco.errors import ConfigError
from pulseloco.integrations.swarm_rollouts import RolloutConfig
from pulseloco.keys import check_run_id, policy_run_id
from pulseloco.loco.config import AveragingConfig, PlacementConfig, RoundConfig
from pulseloco.loco.selection import SelectorName
from pulseloco.rollouts.verify_config import VerifyConfig
from pulseloco.swarm import SwarmConfig
from pulseloco.sync.publisher import DEFAULT_ANCHOR_EVERY

_Part = TypeVar("_Part", SwarmConfig, RoundConfig, AveragingConfig, PlacementConfig, RolloutConfig, VerifyConfig)

STRATEGIES: dict[str, SelectorName | None] = {
    "ddp": None,
    "diloco": "dense",
    "pulseloco": "pulse",
    "sparseloco": "sparseloco",
}
"""Strategy -> PulseLoCo selector; ``ddp`` (``None``) is the Trainer's own data parallelism, no swarm."""


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


def _part(options: Any, cls: type[_Part], **override: Any) -> _Part:
    """The ``cls`` (a group of options these arguments inherit) built from ``options``' values of its fields; its
    checks run (:class:`ConfigError`)."""
    return cls(**{f.name: getattr(options, f.name) for f in fields(cls)} | override)


@dataclass(kw_only=True)
class SwarmArguments(SwarmConfig):
    """How a process joins the swarm (trainers and rollout workers alike): the run, and the swarm options of
    :class:`pulseloco.swarm.SwarmConfig` (defined there once, with their help texts and checks)."""

    _argument_group_name: ClassVar[str] = "pulseloco: the run and the swarm"

    run_id: str = field(
        default="pulseloco",
        metadata=_help("Peers with the same run_id average together; rollout workers follow `<run_id>.policy`."),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_run_id(self.run_id)

    @property
    def policy_run_id(self) -> str:
        """The PULSESync run that rollout workers follow."""
        return policy_run_id(self.run_id)

    def swarm_config(self) -> SwarmConfig:
        """The :class:`pulseloco.swarm.SwarmConfig` part of these options (checked when they were parsed)."""
        return _part(self, SwarmConfig)


@dataclass(kw_only=True)
class PulseLoCoArguments(PlacementConfig, AveragingConfig, RoundConfig, SwarmArguments):
    """How this training run averages with its swarm and publishes versions to rollout workers.

    The options of the swarm (:class:`pulseloco.swarm.SwarmConfig`), of PulseLoCo's round, averaging and
    placement (:mod:`pulseloco.loco.config`) are those classes' fields, defined and checked there once; the
    selector is chosen by ``--strategy``. Each group is checked when the arguments are parsed."""

    _argument_group_name: ClassVar[str] = "pulseloco: the swarm, PULSELoCo's rounds and PULSESync"

    strategy: str = field(
        default="pulseloco",
        metadata=_help(
            "ddp: the Trainer's own data parallelism across the processes of one `accelerate launch`, no swarm. "
            "diloco / pulseloco / sparseloco: this launch is one swarm peer averaging every inner_steps optimizer "
            "steps with the dense / pulse / sparseloco selector."
        ),
    )
    selector: SelectorName | None = field(default=None, init=False)  # type: ignore[assignment]  # from strategy
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
    anchor_every: int = field(
        default=DEFAULT_ANCHOR_EVERY, metadata=_help("A full BF16 anchor every this many versions.")
    )
    publish_every: int = field(
        default=0,
        metadata=_help("Publish every N optimizer steps instead of every outer round (needed with --strategy ddp)."),
    )

    def __post_init__(self) -> None:
        SwarmArguments.__post_init__(self)
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy: unknown strategy {self.strategy!r} (choose from {', '.join(STRATEGIES)})")
        self.selector = STRATEGIES[self.strategy]
        if (self.pulse_values != "float32" or self.pulse_budget is not None) and self.strategy != "pulseloco":
            raise ConfigError(
                f"--pulse_values / --pulse_budget need --strategy pulseloco, got --strategy {self.strategy}"
            )
        self.round_config(), self.averaging_config(), self.placement_config()  # each checks its options
        if self.publish_every < 0:
            raise ConfigError(f"publish_every must be >= 0, got {self.publish_every}")
        if self.publish and not self.signing_key:
            raise ConfigError("--publish needs --signing_key PATH (make one with `pulseloco keygen --out PATH`)")
        if self.publish and self.selector is None and not self.publish_every:
            raise ConfigError("--publish with --strategy ddp has no outer rounds: set --publish_every N (steps)")

    def round_config(self) -> RoundConfig:
        """The :class:`RoundConfig` of these options (the selector of ``--strategy``; ``dense``, unused, for
        ``ddp``). Raises :class:`ConfigError` naming a bad option."""
        return _part(self, RoundConfig, selector=self.selector or "dense")

    def averaging_config(self) -> AveragingConfig:
        """The :class:`AveragingConfig` of these options; raises :class:`ConfigError` naming a bad one."""
        return _part(self, AveragingConfig)

    def placement_config(self) -> PlacementConfig:
        """The :class:`PlacementConfig` of these options; raises :class:`ConfigError` naming a bad one."""
        return _part(self, PlacementConfig)

    def callbacks(self, *, output_dir: str | Path | None = None, max_steps: int | None = None) -> list[Any]:
        """The Trainer callbacks of these options: a :class:`PulseLoCoCallback` for swarm strategies and a
        :class:`PulseSyncCallback` with ``--publish``; none for plain ``ddp``. Round metrics go to
        ``<output_dir>/pulseloco_rounds.jsonl`` and published versions to ``<output_dir>/pulsesync_versions.jsonl``
        when ``output_dir`` is given. With ``max_steps`` (the Trainer's), a swarm strategy checks at once that the
        run ends on an outer-round boundary (the callback checks again when training starts); raises
        :class:`ConfigError` naming the flags."""
        from pulseloco.integrations.pulsesync import VERSIONS_FILE, PulseSyncCallback
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
                round_config=self.round_config(),
                averaging_config=self.averaging_config(),
                placement_config=self.placement_config(),
                linger=self.linger,
                metrics_path=None if out is None else out / "pulseloco_rounds.jsonl",
            )
            callbacks.append(loco)
        if self.publish:
            store = Path(self.store_dir) if self.store_dir else (out or Path(".")) / "versions"
            callbacks.append(
                PulseSyncCallback(
                    signing_key=self.signing_key,
                    run_id=self.run_id,
                    store_dir=store,
                    anchor_every=self.anchor_every,
                    every=self.publish_every or "round",
                    swarm=None if loco is not None else self.swarm_config(),
                    linger=self.linger,
                    metrics_path=False if out is None else out / VERSIONS_FILE,
                )
            )
        return callbacks


ROLLOUT_SOURCES = ("local", "swarm")


@dataclass(kw_only=True)
class PublicKeyArguments:
    """Whose versions to trust: the publisher's public key (trainers that do not publish, rollout workers)."""

    public_key: str | None = field(
        default=None,
        metadata=_help(
            "The publisher's public key (the .pub written by `pulseloco keygen`): only versions it signed are used. "
            "Needed by a rollout worker, and with --rollouts swarm by a trainer that does not --publish itself."
        ),
    )


@dataclass(kw_only=True)
class RolloutArguments(PublicKeyArguments, VerifyConfig, RolloutConfig):
    """Where a GRPO trainer's completions come from: its own model (TRL's generation) or the swarm's rollout
    workers (:class:`pulseloco.integrations.swarm_rollouts.SwarmRollouts`, TRL's ``rollout_func``). How the
    workers are used and how their completions are checked are the fields of
    :class:`~pulseloco.integrations.swarm_rollouts.RolloutConfig` and
    :class:`~pulseloco.rollouts.verify.VerifyConfig`, defined and checked there once."""

    _argument_group_name: ClassVar[str] = "pulseloco: rollouts from the swarm's workers and their checks"

    rollouts: str = field(
        default="local",
        metadata=_help(
            "local: the trainer generates its completions itself. swarm: rollout workers that follow this run's "
            "versions generate them (recipes/rollout_worker.py --serve_rollouts)."
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

    def __post_init__(self) -> None:
        if self.rollouts not in ROLLOUT_SOURCES:
            raise ConfigError(f"rollouts must be one of {', '.join(ROLLOUT_SOURCES)}, got {self.rollouts!r}")
        _part(self, RolloutConfig), _part(self, VerifyConfig)  # each checks its options

    def rollout_func(self, pulse_args: PulseLoCoArguments, *, output_dir: str | Path | None = None) -> Any:
        """The ``rollout_func`` for TRL's ``GRPOTrainer``: a :class:`SwarmRollouts` with ``--rollouts swarm``, else
        None (TRL generates). It joins the swarm of ``pulse_args`` (the DHT of the PulseLoCo or PulseSync callback
        when there is one) and writes ``<output_dir>/rollouts.jsonl``. Raises :class:`ConfigError` when neither
        ``--public_key`` nor ``--publish`` says which versions exist."""
        if self.rollouts == "local":
            return None
        from pulseloco.integrations.swarm_rollouts import ROLLOUTS_FILE, SwarmRollouts
        from pulseloco.rollouts.verify import RolloutVerifier

        if not self.public_key and not pulse_args.publish:
            raise ConfigError(
                "--rollouts swarm needs --public_key PATH (the publisher's .pub file), or --publish on this trainer"
            )
        return SwarmRollouts(
            swarm=pulse_args.swarm_config(),
            run_id=pulse_args.run_id,
            public_key=self.public_key,
            config=_part(self, RolloutConfig),
            verify=self.verify_rollouts,
            verifier=RolloutVerifier(_part(self, VerifyConfig)),
            metrics_path=False if output_dir is None else Path(output_dir) / ROLLOUTS_FILE,
        )
