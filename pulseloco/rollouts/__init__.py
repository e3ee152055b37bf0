"""The rollout loop across the swarm: rollout workers generate the trainers' data.

- :mod:`~pulseloco.rollouts.protocol`: leases, replies and worker records, and the checks of each;
- :mod:`~pulseloco.rollouts.worker`: :class:`RolloutServer`, a worker's lease handler beside its subscriber;
- :mod:`~pulseloco.rollouts.client`: :class:`RolloutClient`, the trainer's leases, re-leases and reply checks;
- :mod:`~pulseloco.rollouts.sampling`: the replayable (keyed Gumbel-max) sampling rule and the trainer's check of it;
- :mod:`~pulseloco.rollouts.tolerances`: the measured numerics the checks allow;
- :mod:`~pulseloco.rollouts.verify`: :class:`RolloutVerifier`, the trainer's check of a worker's completions
  against the version's weights;
- :mod:`~pulseloco.rollouts.engines`: what a worker generates with (transformers, vLLM).

TRL's ``GRPOTrainer`` uses them through :class:`pulseloco.integrations.swarm_rollouts.SwarmRollouts`.
"""
