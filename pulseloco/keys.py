"""The names a swarm run uses in the DHT, in one scheme: ``pulseloco:<run id>:<what>``.

A training run ``RUN`` averages under its own run id (PULSELoCo's records) and publishes its weights under the
PULSESync run id :func:`policy_run_id` (``RUN.policy``), which rollout workers follow and under which they
announce themselves. Every module that reads or writes a DHT record takes its key from here.
"""

from __future__ import annotations

from pulseloco.errors import ConfigError

__all__ = [
    "MAX_RUN_ID_LENGTH",
    "POLICY_SUFFIX",
    "check_run_id",
    "check_training_run_id",
    "head_key",
    "loco_round_key",
    "loco_state_key",
    "policy_run_id",
    "providers_key",
    "refused_key",
    "training_run_id",
    "workers_key",
]

POLICY_SUFFIX = ".policy"
"""What turns a training run id into the PULSESync run id its weights are published under."""


MAX_RUN_ID_LENGTH = 100


def check_run_id(run_id: str, option: str = "run_id") -> str:
    """``run_id`` when it can name a run's DHT records: 1 to :data:`MAX_RUN_ID_LENGTH` characters without
    whitespace. Raises :class:`ConfigError` naming ``option`` (the flag or argument it came from) otherwise."""
    if not run_id or any(c.isspace() for c in run_id) or len(run_id) > MAX_RUN_ID_LENGTH:
        raise ConfigError(f"{option} must be 1-{MAX_RUN_ID_LENGTH} characters without spaces, got {run_id!r}")
    return run_id


def check_training_run_id(run_id: str, option: str = "run_id") -> str:
    """``run_id`` when it is a bare training run id (:func:`check_run_id`, and not already a PULSESync
    run id ending in ``.policy``: the code derives that one). Raises :class:`ConfigError` naming ``option``."""
    check_run_id(run_id, option)
    if run_id.endswith(POLICY_SUFFIX):
        raise ConfigError(
            f"{option} is the training run id, without {POLICY_SUFFIX!r} (workers follow '<run_id>{POLICY_SUFFIX}', "
            f"derived from it): give {option}={run_id.removesuffix(POLICY_SUFFIX)!r}, not {run_id!r}"
        )
    return run_id


def policy_run_id(run_id: str) -> str:
    """The PULSESync run id a training run ``run_id`` publishes its weights under (``run_id.policy``)."""
    return f"{run_id}{POLICY_SUFFIX}"


def training_run_id(sync_run_id: str) -> str:
    """The training run id of a PULSESync run id (the inverse of :func:`policy_run_id`; unchanged without the
    suffix)."""
    return sync_run_id.removesuffix(POLICY_SUFFIX)


def _key(run_id: str, *what: str) -> str:
    return ":".join(("pulseloco", run_id, *what))


def loco_round_key(run_id: str, round_index: int, what: str) -> str:
    """A PULSELoCo round's matchmaking records (``what``: ``peers``, ``view0`` ...; subkey: peer id)."""
    return _key(run_id, "loco", f"r{round_index}", what)


def loco_state_key(run_id: str) -> str:
    """PULSELoCo's state records: each trainer's last completed round and digest (subkey: peer id)."""
    return _key(run_id, "loco", "state")


def head_key(run_id: str) -> str:
    """PULSESync run ``run_id``'s signed head record."""
    return _key(run_id, "head")


def providers_key(run_id: str) -> str:
    """Who serves PULSESync run ``run_id``'s objects: the publisher and relaying subscribers (subkey: peer id)."""
    return _key(run_id, "providers")


def workers_key(run_id: str) -> str:
    """The rollout workers of PULSESync run ``run_id`` (subkey: peer id)."""
    return _key(run_id, "rollout_workers")


def refused_key(run_id: str) -> str:
    """The workers the trainers of PULSESync run ``run_id`` refused (subkey: trainer; value: worker -> reason)."""
    return _key(run_id, "refused_workers")
