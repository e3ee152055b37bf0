"""The ``pulseloco`` command.

One argparse parser with one subparser per command. ``main`` returns a process exit code instead of exiting,
so tests can call it in-process; the console script and ``python -m pulseloco.cli`` turn that code into the
exit status.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from pulseloco import __version__

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
"""Exit code for command-line usage errors (argparse's convention)."""


def _cmd_version(args: argparse.Namespace) -> int:
    """Print the installed pulseloco version."""
    print(f"pulseloco {__version__}")
    return 0


_COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "version": (_cmd_version, "print the pulseloco version and exit"),
}
"""Command name -> (handler, one-line help). A new command adds one row here."""


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


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser for every ``pulseloco`` command."""
    parser = argparse.ArgumentParser(
        prog="pulseloco",
        description="Decentralized training with precision-gated sparse exchange (PULSELoCo, PULSESync).",
        parents=[_global_options()],
    )
    parser.add_argument("--version", action="version", version=f"pulseloco {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (handler, help_text) in _COMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        subparser.set_defaults(handler=handler)
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
    parser = build_parser()
    known = ", ".join(sorted(_COMMANDS))
    try:
        # argparse's message for a bad subcommand ("argument COMMAND: invalid choice: ...") hides what went
        # wrong; find the command word after the global options and name it ourselves.
        try:
            _, rest = _global_options(exit_on_error=False).parse_known_args(args_list)
        except argparse.ArgumentError:
            rest = []  # a bad global option: the full parse below reports it with the full usage
        command = next((arg for arg in rest if not arg.startswith("-")), None)
        if command is not None and command not in _COMMANDS:
            return _usage_error(parser, f"unknown command {command!r} (choose from: {known})")
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse exits on --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE

    if args.command is None:
        return _usage_error(parser, f"a command is required (choose from: {known})")

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.debug("command=%s", args.command)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
