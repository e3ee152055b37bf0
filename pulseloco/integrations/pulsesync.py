"""``PulseSyncCallback``: a Trainer publishes its weights to rollout workers as signed PULSESync versions.

It publishes the starting weights as the first version, then the consensus weights after every PULSELoCo outer
round (``every="round"``, with a :class:`~pulseloco.integrations.trainer.PulseLoCoCallback` on the same Trainer) or
every ``every`` optimizer steps; with PULSELoCo and ``every=N`` it publishes both (the consensus after every round
and, between rounds, this peer's own weights every N optimizer steps). Its numbers reach the Trainer's logs as
``pulsesync/*`` (:mod:`pulseloco.integrations.callback_base`).

Without PULSELoCo, a Trainer publishes every N steps and joins the swarm itself::

    PulseSyncCallback(signing_key="keys/publisher", run_id="my-run", every=1,
                      swarm=SwarmConfig(initial_peers=["/ip4/.../p2p/..."]))

Failure behaviour: bad arguments raise :class:`~pulseloco.errors.ConfigError` at construction or at train begin
(``every="round"`` without a PulseLoCoCallback, no run id to be found, run ids that disagree); a swarm that cannot
be joined raises :class:`~pulseloco.errors.SwarmUnreachableError` on every process; publishing runs in the
publisher's thread and never fails a step; the wait for a copy at train end is bounded (``wait_for_copy``) and
never raises.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from accelerate import PartialState
from transformers import TrainerControl, TrainerState, TrainingArguments

from pulseloco.errors import ConfigError
from pulseloco.integrations.callback_base import (
    LogsContributor,
    check_linger,
    check_rollouts_at_start,
    join_swarm,
    loco_callback_of,
)
from pulseloco.jsonl import JsonLinesWriter
from pulseloco.keys import POLICY_SUFFIX, check_training_run_id, policy_run_id
from pulseloco.swarm import SwarmConfig
from pulseloco.sync.publisher import DEFAULT_ANCHOR_EVERY, check_anchor_every

if TYPE_CHECKING:
    from pulseloco.integrations.trainer import PulseLoCoCallback
    from pulseloco.loco.optimizer import PulseLoCo
    from pulseloco.sync.publisher import PublishedVersion

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_WAIT_FOR_COPY", "VERSIONS_FILE", "PulseSyncCallback"]

VERSIONS_FILE = "pulsesync_versions.jsonl"
"""The published versions' JSON lines, in the Trainer's ``output_dir`` unless ``metrics_path`` says otherwise (the
name the recipes use)."""

DEFAULT_WAIT_FOR_COPY = 60.0
"""Seconds a publisher waits at train end, at most, for another peer to hold its last version."""

_COPY_POLL_SECONDS = 0.5


@dataclass
class _VersionTotals:
    """The versions stored since the last log."""

    num_versions: int = 0
    version: int = 0
    patch_bytes: int = 0
    seconds: float = 0.0

    def add(self, published: PublishedVersion) -> None:
        self.num_versions += 1
        self.version = max(self.version, published.version)
        self.patch_bytes += published.patch_bytes
        self.seconds += published.seconds

    def entries(self) -> dict[str, float]:
        if not self.num_versions:
            return {}
        return {
            "pulsesync/version": self.version,
            "pulsesync/num_versions": self.num_versions,
            "pulsesync/patch_bytes": self.patch_bytes,
            "pulsesync/seconds_publish": self.seconds / self.num_versions,
        }


class PulseSyncCallback(LogsContributor):
    """Publishes the Trainer's model to rollout workers with PULSESync.

    Args:
        publisher: a ready :class:`pulseloco.sync.publisher.Publisher` (main process only; ``None`` elsewhere).
            Without one, give ``signing_key``: the callback then makes a publisher on the main process when
            training begins, over the DHT of the :class:`PulseLoCoCallback` on the same Trainer (or ``dht``, or
            one it starts from ``swarm``), and closes it when training ends.
        every: ``"round"`` to publish after every outer round of the :class:`PulseLoCoCallback` driving the same
            model (the consensus ``theta``), or a number of optimizer steps N. With a PulseLoCoCallback and N, the
            consensus is still published after every round (never the pre-averaging weights of a round's last
            step), and between rounds the publishing peer's local weights every N steps.
        signing_key: the publisher's Ed25519 private key, or a path to it (``pulseloco keygen --out PATH``).
        run_id: the training run id, the same everywhere (``SwarmRollouts(run_id=...)``, the worker's ``--run_id``):
            versions are published under ``<run_id>.policy`` (:func:`pulseloco.keys.policy_run_id`), which the
            workers follow. Default: the ``run_id`` of the :class:`PulseLoCoCallback` on the same Trainer, else that
            of the Trainer's ``rollout_func`` when it is a :class:`~pulseloco.integrations.SwarmRollouts`; with
            neither, training begins with a :class:`ConfigError` asking for it (no default run id that no worker
            follows). A ``run_id`` that disagrees with theirs raises :class:`ConfigError` when training begins.
        store_dir: the version store (default: ``<output_dir>/versions``).
        anchor_every: a full BF16 anchor every this many versions.
        dht, swarm: the DHT to publish on, or how to start one (``SwarmConfig(initial_peers=[MADDR])`` to join a
            bootstrap peer), when there is no PulseLoCoCallback.
        linger: seconds to keep serving after training (before the wait below), when this callback started the DHT.
        wait_for_copy: at train end, a publisher this callback made keeps serving until its last version is held
            by another peer: a relaying subscriber announcing it in the providers record or a rollout worker whose
            record says it serves it (what ``pulseloco status`` shows), for at most this many seconds, so that a
            trainer that leaves at once does not take the last version with it. It prints one line saying what it
            waits for and one when a copy is held or the time ran out. It does not wait when no other peer follows
            the run (no worker or provider record besides its own). ``0``: leave at once.
        metrics_path: where to append one JSON line per stored version (``version``, ``digest``, ``patch_bytes``,
            ``seconds_publish``, ``announced``: :class:`pulseloco.sync.publisher.PublishedVersion`). ``None`` (the
            default): ``<output_dir>/pulsesync_versions.jsonl`` of the Trainer's ``args.output_dir`` on the main
            process; ``False``: no file.
        flush_timeout: seconds to wait at the end for the last version to be encoded and stored.

    Metrics: the Trainer's next log after one or more versions were stored gets (on the main process, the one
    that publishes; ``train/pulsesync/...`` in TensorBoard and W&B):

    * ``pulsesync/version``: the newest version stored;
    * ``pulsesync/num_versions``: the versions this log covers (queued versions superseded before they were
      encoded are not stored and not counted); the sum and mean below are over them;
    * ``pulsesync/patch_bytes``: the sum of their patch sizes (0 for the first, anchor-only version);
    * ``pulsesync/seconds_publish``: the mean, over them, of the seconds from queueing the version (right after
      the optimizer step or outer round it follows) to the end of its announce in the DHT: the publisher's
      wait for the previous version, encoding, signing, store writes and announce.

    The publisher works in the background, so a version usually reaches the log after the one of the step that
    queued it; at the last log of training the callback first waits (``flush_timeout``) for the last version.
    """

    def __init__(
        self,
        publisher: Any | None = None,
        *,
        every: str | int = "round",
        signing_key: Any | None = None,
        run_id: str | None = None,
        store_dir: str | os.PathLike[str] | None = None,
        anchor_every: int = DEFAULT_ANCHOR_EVERY,
        dht: Any | None = None,
        swarm: SwarmConfig | None = None,
        linger: float = 0.0,
        wait_for_copy: float = DEFAULT_WAIT_FOR_COPY,
        metrics_path: str | os.PathLike[str] | Literal[False] | None = None,
        flush_timeout: float = 120.0,
    ) -> None:
        if every != "round" and not (isinstance(every, int) and every >= 1):
            raise ConfigError(f"every must be 'round' or a positive number of optimizer steps, got {every!r}")
        if publisher is not None and signing_key is not None:
            raise ConfigError("give publisher= or signing_key=, not both")
        check_anchor_every(anchor_every)  # here, not when training starts
        check_linger(linger)
        if not (wait_for_copy >= 0 and wait_for_copy < float("inf")):
            raise ConfigError(f"wait_for_copy must be >= 0 seconds, got {wait_for_copy}")
        if run_id is not None:
            check_training_run_id(run_id)
        #: the file the key was read from, so that a hint can name its ``.pub`` (None for a key object)
        self.signing_key_path: str | None = None
        if isinstance(signing_key, str | os.PathLike):
            from pulseloco.sync.signing import load_private_key

            self.signing_key_path = str(signing_key)
            signing_key = load_private_key(signing_key)  # fails here, with a clear message, not mid-training
        self.publisher = publisher
        self.every = every
        self.signing_key = signing_key
        #: the training run id as given; :attr:`training_run_id` is the one in use once training began
        self.run_id = run_id
        self.training_run_id: str | None = run_id
        self.store_dir = store_dir
        self.anchor_every = anchor_every
        self.dht = dht
        self.swarm = swarm
        self.linger = linger
        self.wait_for_copy = wait_for_copy
        self.flush_timeout = flush_timeout
        self.metrics_path = metrics_path
        self.metrics: JsonLinesWriter | None = None  # opened when training begins (the default is in output_dir)
        self._rollouts_run_id: str | None = None  # that of the Trainer's SwarmRollouts, seen at train begin
        self._model: torch.nn.Module | None = None
        self._owned_dht: Any | None = None
        self._owns_publisher = False
        self._closed = False
        self._attached = False
        self._step = 0
        self._loco: PulseLoCo | None = None  # that of a PulseLoCoCallback on the same model, once attached
        self._round_at_step_begin: tuple[int, int] | None = None  # (round, inner step) when the step began
        #: called with (version, BF16 state) after each version this process publishes (the trainer's own check
        #: of rollouts keeps them: :class:`pulseloco.rollouts.verify.VersionStates`)
        self.version_listeners: list[Callable[[int, dict[str, torch.Tensor]], None]] = []
        #: called with each :class:`~pulseloco.sync.publisher.PublishedVersion` once its announce is done or has
        #: failed (the trainer's rollout client learns the newest version here, without reading the DHT)
        self.announce_listeners: list[Callable[[PublishedVersion], None]] = []
        self._last_announced: PublishedVersion | None = None
        #: called with (version, signed head record) as soon as each version's head is signed (add_head_listener)
        self.head_listeners: list[Callable[[int, bytes], None]] = []
        self._last_published: tuple[int, int] | None = None  # (version, step) of the last version published
        self._versions_lock = threading.Lock()
        self._versions = _VersionTotals()  # stored since the last log

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._run_before_log_readers(warn=True)
        self._model = kwargs.get("model")
        if self._model is None:
            raise ConfigError("PulseSyncCallback needs the Trainer's model (transformers passes it to callbacks)")
        self._step = state.global_step
        rollouts = check_rollouts_at_start(self)
        if rollouts is not None:
            self._rollouts_run_id = rollouts.run_id

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Set up at the first step: by then every callback's on_train_begin has run, whatever their order, so a
        # PulseLoCoCallback driving this model exists (and its DHT).
        if not self._attached and self._model is not None:
            self._attach(args)
        if self._loco is not None:
            self._round_at_step_begin = (self._loco.round, self._loco.local_step)

    def _attach(self, args: TrainingArguments) -> None:
        assert self._model is not None  # noqa: S101 (the caller checks)
        self._attached = True
        loco = loco_callback_of(self._model)
        if loco is not None and loco.loco is None:
            loco = None
        if self.every == "round" and loco is None:
            raise ConfigError(
                "PulseSyncCallback(every='round') needs a PulseLoCoCallback on the same Trainer; without "
                "PULSELoCo, publish every N optimizer steps with every=N"
            )
        self.training_run_id = self._resolve_run_id(loco)
        from pulseloco.integrations.trl_warnings import explain_trl_warnings

        explain_trl_warnings()
        if self.publisher is None and self.signing_key is not None:
            self._make_publisher(args, loco)
        if self.publisher is not None:
            if self.metrics_path is None:
                self.metrics = JsonLinesWriter(Path(str(args.output_dir)) / VERSIONS_FILE, stamp=True)
            elif self.metrics_path is not False:
                self.metrics = JsonLinesWriter(self.metrics_path, stamp=True)
            self.publisher.add_announce_listener(self._record)
            self.publisher.add_head_listener(self._head_signed)
        if loco is not None:
            assert loco.loco is not None  # noqa: S101 (checked above)
            self._loco = loco.loco
            self._loco.add_round_listener(lambda _loco, _metrics: self._publish("round"))
            loco.add_close_hooks(self.flush, self.close)  # serve the last version while the peer lingers
        self._publish("start")

    def _resolve_run_id(self, loco: PulseLoCoCallback | None) -> str:
        """The training run id to publish under (see ``run_id`` in the class docstring); raises
        :class:`ConfigError` when there is none or the given ones disagree."""
        given, rollouts = self.run_id, self._rollouts_run_id
        others = {"PulseLoCoCallback": loco.run_id if loco is not None else None, "SwarmRollouts": rollouts}
        for name, other in others.items():
            if other is not None and given is not None and other != given:
                raise ConfigError(
                    f"PulseSyncCallback(run_id={given!r}) and the Trainer's {name}(run_id={other!r}) disagree: "
                    f"workers follow one run; give the same training run id to both"
                )
            given = given or other
        if given is None:
            raise ConfigError(
                "PulseSyncCallback needs the training run id: give run_id='RUN' (the rollout workers' --run_id; "
                f"versions go to 'RUN{POLICY_SUFFIX}'), or put a PulseLoCoCallback or SwarmRollouts with one on the "
                "same Trainer"
            )
        return given

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._step = state.global_step
        if not isinstance(self.every, int) or state.global_step % self.every != 0:
            return
        if self._loco is not None and self._round_at_step_begin is not None:
            # A step that ends a round is published by the round listener, after the outer step, whichever of the
            # two callbacks runs first: the round has run already (its number changed) or is about to (this was
            # the round's last inner step). A step the gradient scaler skipped counts as no step for PulseLoCo.
            round_begin, inner_begin = self._round_at_step_begin
            if self._loco.round != round_begin or inner_begin + 1 >= self._loco.phase_steps:
                return
            if getattr(kwargs.get("optimizer"), "step_was_skipped", False):
                return
        self._publish("step")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    def flush(self) -> None:
        """Wait (``flush_timeout``) until the last queued version is stored and announced."""
        if self.publisher is None or self._closed:
            return
        try:
            self.publisher.flush(timeout=self.flush_timeout)
        except TimeoutError:
            logger.warning("the last version was still being encoded after %.0f s", self.flush_timeout)

    def close(self) -> None:
        """Flush and, for a publisher this callback made, wait for a copy of the last version (``wait_for_copy``),
        then close it and the DHT it started (after lingering). Idempotent; never raises for the swarm."""
        if self._closed or self.publisher is None:
            return
        self.flush()
        self._closed = True
        if self._owns_publisher:
            if self._owned_dht is not None and self.linger > 0:
                time.sleep(self.linger)
            self.wait_until_copied(self.wait_for_copy)
            self.publisher.close()
            if self._owned_dht is not None:
                self._owned_dht.shutdown()

    def wait_until_copied(self, timeout: float) -> bool:
        """Keep serving until another peer holds the publisher's last version (class docstring, ``wait_for_copy``),
        for at most ``timeout`` seconds (every DHT read is bounded by what is left). Prints what it waits for and
        how it ended. Returns whether a copy is held; True at once with nothing to wait for (no version, no DHT, a
        ``timeout`` of 0, no other peer following the run). Never raises: a DHT error ends the wait, logged."""
        publisher = self.publisher
        version = publisher.version if publisher is not None else None
        endpoint = publisher.endpoint if publisher is not None else None
        if version is None or endpoint is None or timeout <= 0:
            return True
        started = time.monotonic()
        deadline = started + timeout
        try:
            holders, followers = self._copies(endpoint, version, timeout=min(5.0, timeout))
            if holders:
                return True
            if not followers:
                logger.info("no other peer follows run %s: not waiting for a copy of version %d", endpoint.run_id,
                            version)  # fmt: skip
                return True
            print(
                f"pulsesync: waiting up to {timeout:.0f} s for another peer to hold version {version} of run_id="
                f"{endpoint.run_id} ({len(followers)} following) before leaving",
                flush=True,
            )
            while time.monotonic() < deadline:
                time.sleep(_COPY_POLL_SECONDS)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                holders, _ = self._copies(endpoint, version, timeout=min(5.0, left))
                if holders:
                    print(
                        f"pulsesync: version {version} is held by {', '.join(sorted(holders))} after "
                        f"{time.monotonic() - started:.1f} s; leaving",
                        flush=True,
                    )
                    return True
        except Exception as exc:  # a DHT shutting down: leave, the wait is a courtesy
            logger.warning("waiting for a copy of version %d ended: %r", version, exc)
            return False
        print(
            f"pulsesync: no other peer held version {version} after {timeout:.0f} s (wait_for_copy); leaving without "
            "a copy of it in the swarm",
            flush=True,
        )
        return False

    @staticmethod
    def _copies(endpoint: Any, version: int, *, timeout: float) -> tuple[set[str], set[str]]:
        """``(peers holding version or newer, peers following the run)``, this one excluded, from the providers
        record (complete objects) and the rollout workers' records."""
        from pulseloco.keys import workers_key
        from pulseloco.rollouts.protocol import parse_worker_record

        own = endpoint.peer_id.to_base58()
        holders: set[str] = set()
        followers: set[str] = set()
        for peer, info in endpoint.get_providers(timeout=timeout).items():
            if peer == own or info["publisher"]:
                continue
            followers.add(peer)
            if any(v >= version and v not in info["partial"] for v in info["versions"]):
                holders.add(peer)
        try:
            found = endpoint.dht.get(workers_key(endpoint.run_id), latest=True, return_future=True).result(timeout)
        except concurrent.futures.TimeoutError:
            found = None  # asked again at the next poll
        if found is not None and isinstance(found.value, dict):
            for peer, item in found.value.items():
                worker = parse_worker_record(getattr(item, "value", None))
                if worker is None or not isinstance(peer, str):
                    continue
                followers.add(peer)
                if worker.version >= version:
                    holders.add(peer)
        return holders, followers

    def _make_publisher(self, args: TrainingArguments, loco: PulseLoCoCallback | None) -> None:
        if not PartialState().is_main_process or self.signing_key is None:
            return
        from pulseloco.sync.publisher import Publisher

        dht = self.dht
        if dht is None and loco is not None:
            dht = loco.dht
        if dht is None:
            self._owned_dht = dht = join_swarm(self.swarm or SwarmConfig())
        assert self.training_run_id is not None  # noqa: S101 (resolved by _attach)
        run_id = policy_run_id(self.training_run_id)
        store = Path(self.store_dir) if self.store_dir is not None else Path(str(args.output_dir)) / "versions"
        self.publisher = Publisher(dht, run_id, self.signing_key, store, anchor_every=self.anchor_every)
        self._owns_publisher = True
        print(f"pulsesync: publishing run_id={run_id} store={store}", flush=True)
        held = self.publisher.version
        if held is not None and self._step == 0:
            # a rerun into the same output_dir: the version numbers go on (a follower takes no lower version), the
            # weights start over; nothing of the earlier run is deleted
            print(
                f"pulsesync: {store} already holds versions up to {held} of an earlier run; this run publishes from "
                f"version {held + 1} on under the same run id, and its workers follow it there. To start over, "
                "give another output_dir (or store_dir), or remove that folder",
                flush=True,
            )
        elif held is not None:
            print(f"pulsesync: resuming at version {held + 1} (training resumed at step {self._step})", flush=True)

    @property
    def dht_in_use(self) -> Any | None:
        """The DHT the publisher runs on (given, started by this callback, or its PulseLoCoCallback's); None before
        the publisher exists and on processes other than the main one."""
        if self.publisher is None or self.publisher.endpoint is None:
            return None
        return self.publisher.endpoint.dht

    @property
    def queued_version(self) -> int | None:
        """The newest version this process queued for publishing (it may not be stored or announced yet); None
        before the first."""
        return self._last_published[0] if self._last_published is not None else None

    def _record(self, published: PublishedVersion) -> None:
        """The publisher's announce listener (its thread): the JSON line and the totals of the next log, then
        :attr:`announce_listeners` (one that raises is logged and changes nothing)."""
        with self._versions_lock:
            self._versions.add(published)
            self._last_announced = published
            listeners = list(self.announce_listeners)
        for listener in listeners:
            try:
                listener(published)
            except Exception:  # a listener must not stop the publisher's thread
                logger.exception("announce listener failed version=%d", published.version)
        if self.metrics is not None:
            self.metrics.write(
                event="publish",
                version=published.version,
                digest=published.digest,
                patch_bytes=published.patch_bytes,
                seconds_publish=round(published.seconds, 4),
                announced=published.announced,
            )

    def _take_log_entries(self) -> dict[str, float]:
        with self._versions_lock:
            versions, self._versions = self._versions, _VersionTotals()
        return versions.entries()

    def _before_last_log(self) -> None:
        self.flush()  # the last version (queued by the last step or round) is then in the last log

    def add_announce_listener(self, listener: Callable[[PublishedVersion], None]) -> None:
        """Call ``listener(PublishedVersion)`` from the publisher's thread after each version this process announces
        from now on (``announced`` says whether the DHT took its head record), and at once for the last one
        announced before."""
        with self._versions_lock:
            self.announce_listeners.append(listener)
            last = self._last_announced
        if last is not None:
            listener(last)

    def add_head_listener(self, listener: Callable[[int, bytes], None]) -> None:
        """Call ``listener(version, signed head record)`` from the publisher's thread as soon as each version this
        process publishes from now on has its head signed, before the DHT stores it
        (:meth:`pulseloco.sync.publisher.Publisher.add_head_listener`): a trainer pushes it to its rollout workers.
        An exception it raises is logged and changes nothing."""
        self.head_listeners.append(listener)

    def _head_signed(self, version: int, head: bytes) -> None:
        for listener in list(self.head_listeners):
            try:
                listener(version, head)
            except Exception:  # a listener must not stop the publisher's thread
                logger.exception("head listener failed version=%d", version)

    def add_version_listener(self, listener: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
        """Call ``listener(version, BF16 state)`` after each version this process publishes from now on, and at once
        for the last one when the model has not taken a step since (a version published at train begin)."""
        self.version_listeners.append(listener)
        last = self._last_published
        if last is not None and last[1] == self._step and self._model is not None:
            from pulseloco.sync.publisher import bf16_snapshot

            listener(last[0], bf16_snapshot(self._model))

    def _publish(self, why: str) -> None:
        if self.publisher is None or self._model is None or self._closed:
            return
        version = self.publisher.publish(self._model)
        logger.info("queued version=%d step=%d reason=%s", version, self._step, why)
        self._last_published = (version, self._step)
        if self.version_listeners:
            from pulseloco.sync.publisher import bf16_snapshot

            state = bf16_snapshot(self._model)  # the values the publisher signs as this version
            for listener in self.version_listeners:
                listener(version, state)
