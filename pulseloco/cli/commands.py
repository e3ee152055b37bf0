"""The ``pulseloco`` command.

One argparse parser with one subparser per command. ``main`` returns a process exit code instead of exiting,
so tests can call it in-process; the console script, ``python -m pulseloco`` and ``python -m pulseloco.cli`` turn
that code into the exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pulseloco import __version__
from pulseloco.errors import ConfigError, PulseLocoError, SwarmUnreachableError
from pulseloco.keys import POLICY_SUFFIX, check_run_id, policy_run_id
from pulseloco.signals import stop_on_signals

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
"""Exit code for command-line usage errors (argparse's convention)."""


def _cmd_version(args: argparse.Namespace) -> int:
    """Print the installed pulseloco version."""
    print(f"pulseloco {__version__}")
    return 0


def _swarm_options() -> argparse.ArgumentParser:
    """The swarm options, for a command's ``parents``: the fields of :class:`pulseloco.swarm.SwarmConfig` (their
    one definition), read by transformers' ``HfArgumentParser`` as the recipes read them (``--initial-peers`` and
    ``--initial_peers`` alike). Built only for the command that runs: it imports transformers and hivemind."""
    from transformers import HfArgumentParser

    from pulseloco.swarm import SwarmConfig

    dataclass_types: list[Any] = [SwarmConfig]  # transformers types them as a NewType of Any
    return HfArgumentParser(dataclass_types, add_help=False)


def _swarm_config(args: argparse.Namespace):  # -> SwarmConfig, imported lazily to keep `pulseloco version` fast
    """The :class:`pulseloco.swarm.SwarmConfig` of a command's swarm options; raises :class:`ConfigError` naming a
    bad one."""
    from pulseloco.swarm import SwarmConfig

    return SwarmConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SwarmConfig)})


def _join_as_reader(args: argparse.Namespace) -> None:
    """A command that only reads the swarm joins in client mode (nothing to serve, and it works from behind NAT)
    and, unless told otherwise, reserves no relay slot (nothing to be reached for; a relay grants few per IP)."""
    args.client_mode = True
    if args.use_auto_relay is None:
        args.use_auto_relay = False


def _make_dht(args: argparse.Namespace):  # -> hivemind.DHT, imported lazily to keep `pulseloco version` fast
    from pulseloco.swarm import make_dht

    return make_dht(_swarm_config(args))


def _cmd_dht(args: argparse.Namespace) -> int:
    """Run a bootstrap node until interrupted; print the multiaddrs and the line others use to join."""
    from pulseloco.swarm import new_swarm_key

    if args.new_swarm_key:
        if args.swarm_key is None:
            raise ConfigError("--new-swarm-key needs --swarm-key PATH (where to write the key)")
        print(f"wrote a new swarm key to {new_swarm_key(args.swarm_key)}; give it to every peer", flush=True)
    dht = _make_dht(args)
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    key_flag = f" --swarm_key {args.swarm_key}" if args.swarm_key else ""
    print(f"bootstrap peer id: {dht.peer_id}", flush=True)
    for maddr in maddrs:
        print(f"multiaddr: {maddr}", flush=True)
    from pulseloco.rollouts.client import worker_command

    maddr = maddrs[0] if maddrs else "MADDR"
    print("join with (one run id, here my-run, in every command):", flush=True)
    print(
        "  a recipe peer:    accelerate launch recipes/grpo.py --config recipes/configs/grpo-tiny.yaml "
        f"--model_name_or_path MODEL_DIR --run_id my-run --initial_peers {maddr}{key_flag}",
        flush=True,
    )
    print(f"  a rollout worker: {worker_command('my-run', initial_peers=maddr)}{key_flag}", flush=True)
    print(
        f'  your own script:  PulseLoCoCallback(run_id="my-run", initial_peers=["{maddr}"]), or without PULSELoCo '
        f'PulseSyncCallback(..., swarm=SwarmConfig(initial_peers=["{maddr}"]))',
        flush=True,
    )
    stop = stop_on_signals()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        dht.shutdown()
    return 0


def _add_dht_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new-swarm-key", action="store_true", help="create the --swarm-key file first")


def _cmd_keygen(args: argparse.Namespace) -> int:
    """Write a new Ed25519 signing key (mode 0600) and its public half (``.pub``), creating missing directories."""
    from pulseloco.sync.signing import generate_key, public_key_fingerprint, save_keypair

    key = generate_key()
    private_path, public_path = save_keypair(key, args.out)
    print(f"private key: {private_path} (keep it secret; never commit it)")
    print(f"public key:  {public_path} (give it to subscribers: --public-key {public_path})")
    print(f"fingerprint: {public_key_fingerprint(key.public_key())}")
    return 0


def _add_keygen_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        required=True,
        help="path of the private key, e.g. keys/publisher (missing directories are created; keys/ is in "
        ".gitignore); the public key goes to OUT.pub",
    )


def _check_store(path: str, create: bool) -> None:
    """Refuse a ``--store`` that is not an existing directory unless ``create``: a mistyped path would otherwise
    serve a new, empty store forever. Raises :class:`ConfigError`."""
    store = Path(path)
    if store.is_dir():
        return
    if store.exists():
        raise ConfigError(f"--store {path} is not a directory")
    if not create:
        raise ConfigError(
            f"store directory {path} does not exist: check --store (the directory the trainer's publisher writes), "
            "or pass --create-store to serve an empty store that a publisher fills later"
        )


def _sync_run_id(run_id: str) -> str:
    """The PULSESync run of ``--run-id`` (a training run id, as ``pulseloco status`` and the recipes take it): its
    ``.policy`` run, which the recipes publish; an id that already ends in ``.policy`` names that run itself."""
    return run_id if run_id.endswith(POLICY_SUFFIX) else policy_run_id(run_id)


_SYNC_RUN_ID_HELP = (
    "the training run id (the recipes' --run_id); its weights are published as RUN_ID.policy, which is the "
    "PULSESync run used (an id already ending in .policy is used as it is)"
)


def _cmd_sync_serve(args: argparse.Namespace) -> int:
    """Serve a version store on the swarm: announce its newest version and serve its objects."""
    from pulseloco.sync.publisher import Publisher
    from pulseloco.sync.signing import load_private_key

    key = load_private_key(args.key)
    _check_store(args.store, args.create_store)
    dht = _make_dht(args)
    try:
        publisher = Publisher(
            dht, _sync_run_id(args.run_id), key, args.store, max_uploads_per_version=args.max_uploads_per_version
        )
    except BaseException:  # a store that does not resume: leave no DHT process behind
        dht.shutdown()
        raise
    for maddr in dht.get_visible_maddrs():
        print(f"serving run={_sync_run_id(args.run_id)} at {maddr}", flush=True)
    print(f"version={publisher.version} digest={publisher.digest}", flush=True)
    stop = stop_on_signals()
    try:
        while not stop.wait(args.poll):
            if publisher.refresh():
                print(f"version={publisher.version} digest={publisher.digest}", flush=True)
    finally:
        publisher.close()
        dht.shutdown()
    return 0


def _add_sync_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, help="version store directory; it must exist (see --create-store)")
    parser.add_argument(
        "--create-store",
        action="store_true",
        help="create --store if it does not exist (to start serving before the trainer writes its first version)",
    )
    parser.add_argument("--run-id", required=True, help=_SYNC_RUN_ID_HELP)
    parser.add_argument("--key", required=True, help="the publisher's private key (from `pulseloco keygen`)")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between checks for new versions")
    from pulseloco.sync.publisher import DEFAULT_MAX_UPLOADS_PER_VERSION

    parser.add_argument(
        "--max-uploads-per-version",
        type=int,
        default=DEFAULT_MAX_UPLOADS_PER_VERSION,
        help="newest patch uploads before relays",
    )


def _cmd_sync_follow(args: argparse.Namespace) -> int:
    """Follow a run and print one line per version."""
    from pulseloco.sync.signing import load_public_key
    from pulseloco.sync.subscriber import Subscriber, UpdateReport

    key = load_public_key(args.public_key)
    if not args.initial_peers:
        raise ConfigError("--initial-peers is required: the multiaddr printed by the publisher or a swarm peer")
    dht = _make_dht(args)
    subscriber = Subscriber(dht, _sync_run_id(args.run_id), key, mirror_dir=args.out, timeout=args.timeout)
    print(f"following run={_sync_run_id(args.run_id)}", file=sys.stderr, flush=True)
    state: dict = {}
    if args.out:
        restored = subscriber.restore(state)
        if restored is not None:
            print(f"restored version={restored} digest={subscriber.digest} from {args.out}", flush=True)
    stop = stop_on_signals()
    print("version changed bytes seconds digest lag path", flush=True)

    def print_report(report: UpdateReport) -> None:
        print(
            f"{report.version} {report.num_changed} {report.bytes_received} {report.seconds:.3f} "
            f"{report.digest} {report.lag} {report.path}",
            flush=True,
        )

    try:
        subscriber.run(state, print_report, interval=args.interval, stop=stop, until_version=args.until_version)
    finally:
        subscriber.close()
        dht.shutdown()
    return 0


def _add_sync_follow_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-id", required=True, help=_SYNC_RUN_ID_HELP)
    parser.add_argument("--public-key", required=True, help="the publisher's public key file (.pub)")
    parser.add_argument("--out", default=None, help="directory keeping received versions (restored on restart)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between checks for a new version")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds allowed for one update")
    parser.add_argument("--until-version", type=int, default=None, help="exit once this version is reached")


def _cmd_status(args: argparse.Namespace) -> int:
    """Print what the DHT says about a run (:mod:`pulseloco.cli.status`); 0 agree, 1 digests disagree, 2 bad
    arguments or the swarm cannot be joined (one line on stderr). Joins in client mode; shuts its DHT down."""
    from pulseloco.cli.status import EXIT_CANNOT_JOIN, collect_status, render_text, to_json
    from pulseloco.sync.signing import load_public_key

    try:
        if not args.initial_peers:
            raise ConfigError("--initial-peers is required: the multiaddr of any peer of the swarm")
        if not (args.timeout > 0 and args.probe_timeout >= 0):
            raise ConfigError("--timeout must be positive and --probe-timeout not negative")
        check_run_id(args.run_id, "--run-id")
        key = load_public_key(args.public_key) if args.public_key else None
        _join_as_reader(args)
        dht = _make_dht(args)
    except (ConfigError, SwarmUnreachableError) as exc:
        print(f"pulseloco: error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_JOIN
    try:
        report = collect_status(
            dht,
            args.run_id,
            sync_run_id=args.sync_run_id,
            public_key=key,
            timeout=args.timeout,
            probe_timeout=args.probe_timeout or None,
        )
    finally:
        dht.shutdown()
    print(to_json(report) if args.json else render_text(report), flush=True)
    return report.exit_code


def _add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-id", default="pulseloco", help="the PULSELoCo run id (default: %(default)s)")
    parser.add_argument(
        "--sync-run-id",
        default=None,
        help="the PULSESync run: head, providers, rollout workers (default: RUN_ID.policy as the recipes publish, "
        "then RUN_ID)",
    )
    parser.add_argument("--public-key", default=None, help="the publisher's public key: verify the head record")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds for each DHT lookup")
    parser.add_argument(
        "--probe-timeout", type=float, default=3.0, help="seconds each provider has to answer the probe; 0: no probe"
    )


def _cmd_monitor(args: argparse.Namespace) -> int:
    """Poll the run's DHT records and log the swarm's progress to a tracker (:mod:`pulseloco.cli.monitor`) until
    interrupted (SIGINT, SIGTERM) or ``--duration`` passed; 0 then, 2 for bad arguments, a swarm that cannot be
    joined or a tracker that cannot start, 1 when its DHT process dies (one line on stderr). Joins in client mode;
    flushes the tracker and shuts its DHT down on the way out."""
    from pulseloco.cli.monitor import AccelerateTracker, SwarmMonitor, check_report_to, run_monitor

    try:
        if not args.initial_peers:
            raise ConfigError("--initial-peers is required: the multiaddr of any peer of the swarm")
        if not (args.interval > 0 and args.timeout > 0 and (args.duration is None or args.duration > 0)):
            raise ConfigError("--interval, --timeout and --duration must be positive")
        check_run_id(args.run_id, "--run-id")
        report_to = check_report_to(args.report_to)
        _join_as_reader(args)
        dht = _make_dht(args)
    except (ConfigError, SwarmUnreachableError) as exc:
        print(f"pulseloco: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop = stop_on_signals()
    try:
        tracker = AccelerateTracker(report_to, args.logging_dir, args.run_id) if report_to else None
        run_monitor(
            dht,
            SwarmMonitor(tracker),
            args.run_id,
            stop=stop,
            sync_run_id=args.sync_run_id,
            interval=args.interval,
            duration=args.duration,
            timeout=args.timeout,
            watch=sys.stdout if args.watch else None,
        )
    except ConfigError as exc:
        print(f"pulseloco: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        dht.shutdown()
    return 0


def _add_monitor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-id", default="pulseloco", help="the PULSELoCo run id (default: %(default)s)")
    parser.add_argument(
        "--sync-run-id",
        default=None,
        help="the PULSESync run (default: RUN_ID.policy as the recipes publish, then RUN_ID)",
    )
    parser.add_argument(
        "--report-to",
        "--report_to",
        nargs="+",
        default=["tensorboard"],
        metavar="TRACKER",
        help="accelerate trackers: tensorboard, wandb, trackio, mlflow, ...; none: no tracker (default: tensorboard)",
    )
    parser.add_argument(
        "--logging-dir",
        "--logging_dir",
        default="runs/monitor",
        help="where local trackers write; tensorboard writes LOGGING_DIR/RUN_ID (default: %(default)s)",
    )
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between polls (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: never)")
    parser.add_argument("--watch", action="store_true", help="print a compact view of the swarm after each poll")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds for each DHT lookup")


class _Command(NamedTuple):
    handler: Callable[[argparse.Namespace], int]
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    joins_swarm: bool = False
    """Whether the command takes the swarm options (:func:`_swarm_options`)."""


_SYNC_COMMANDS: dict[str, _Command] = {
    "serve": _Command(
        _cmd_sync_serve, "serve a version store's versions on the swarm", _add_sync_serve_arguments, True
    ),
    "follow": _Command(
        _cmd_sync_follow, "follow a run and print one line per version", _add_sync_follow_arguments, True
    ),
}


def _add_commands(
    parser: argparse.ArgumentParser, commands: dict[str, _Command], dest: str, only: str | None, *, required: bool
) -> None:
    """One subparser per command; the arguments only for the command ``only`` (all when ``None``): a command's
    arguments can import large libraries (:func:`_swarm_options`), and `pulseloco version` should not wait for them."""
    subparsers = parser.add_subparsers(dest=dest, metavar=dest.upper(), title="commands", required=required)
    built = {name for name in commands if only is None or only == name}
    swarm = [_swarm_options()] if any(commands[name].joins_swarm for name in built) else []
    for name, command in commands.items():
        parents = swarm if name in built and command.joins_swarm else []
        subparser = subparsers.add_parser(
            name,
            help=command.help,
            description=command.help,
            parents=parents,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # each option's default, after its help
        )
        subparser.set_defaults(handler=command.handler)
        if name in built:
            command.add_arguments(subparser)


def _add_sync_arguments(parser: argparse.ArgumentParser) -> None:
    _add_commands(parser, _SYNC_COMMANDS, "sync_command", None, required=True)


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


_COMMANDS: dict[str, _Command] = {
    "version": _Command(_cmd_version, "print the pulseloco version and exit", _no_arguments),
    "keygen": _Command(_cmd_keygen, "make an Ed25519 signing key for publishing", _add_keygen_arguments),
    "sync": _Command(_cmd_version, "PULSESync: serve or follow weight versions", _add_sync_arguments),
    "dht": _Command(_cmd_dht, "run a bootstrap node and print how others join", _add_dht_arguments, True),
    "status": _Command(
        _cmd_status,
        "show the run's peers, digests, PULSESync head and rollout workers from the DHT",
        _add_status_arguments,
        True,
    ),
    "monitor": _Command(
        _cmd_monitor,
        "log the swarm's progress from the DHT to a tracker (tensorboard, wandb, ...) every few seconds",
        _add_monitor_arguments,
        True,
    ),
}
"""Command name -> what runs it. A new command adds one row here."""


def _global_options(*, exit_on_error: bool = True) -> argparse.ArgumentParser:
    """Options accepted before the command name."""
    parser = argparse.ArgumentParser(prog="pulseloco", add_help=False, exit_on_error=exit_on_error)
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level for pulseloco and the libraries it uses (default: %(default)s)",
    )
    return parser


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Build the argument parser of the ``pulseloco`` commands: every command's arguments, or only those of
    ``command`` (the others are listed, as ``pulseloco --help`` shows them)."""
    parser = argparse.ArgumentParser(
        prog="pulseloco",
        description="Decentralized training with precision-gated sparse exchange (PULSELoCo, PULSESync).",
        parents=[_global_options()],
    )
    parser.add_argument("--version", action="version", version=f"pulseloco {__version__}")
    _add_commands(parser, _COMMANDS, "command", command, required=False)
    return parser


def _usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    """Print usage and ``message`` to stderr the way argparse does, and return the usage exit code."""
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pulseloco`` command line and return its exit code.

    Args:
        argv: arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The command's exit code: 0 on success, 2 on a usage error (unknown command, bad option, no command).
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    known = ", ".join(sorted(_COMMANDS))
    # argparse's message for a bad subcommand ("argument COMMAND: invalid choice: ...") hides what went wrong;
    # find the command word after the global options and name it ourselves (and build only its arguments).
    try:
        _, rest = _global_options(exit_on_error=False).parse_known_args(args_list)
    except argparse.ArgumentError:
        rest = []  # a bad global option: the full parse below reports it with the full usage
    command = next((arg for arg in rest if not arg.startswith("-")), None)
    parser = build_parser(command if command in _COMMANDS else "")
    try:
        if command is not None and command not in _COMMANDS:
            return _usage_error(parser, f"unknown command {command!r} (choose from: {known})")
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse exits on --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE

    if args.command is None:
        return _usage_error(parser, f"a command is required (choose from: {known})")

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.debug("command=%s", args.command)
    try:
        return int(args.handler(args))
    except PulseLocoError as exc:  # bad configuration or input: one line that says what to fix
        print(f"pulseloco: error: {exc}", file=sys.stderr)
        return 1
