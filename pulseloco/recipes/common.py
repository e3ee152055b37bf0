"""What every recipe does the same way: parse its dataclasses, refuse a used output directory, add the pulseloco
callbacks, and end a bad configuration with one line.

Configuration follows TRL's scripts: ``trl.TrlParser`` over dataclasses (``GRPOConfig`` / ``TrainingArguments``,
``ModelConfig``, the recipe's own, :class:`pulseloco.integrations.args.PulseLoCoArguments`), a flat YAML file
with ``--config FILE``, and command-line flags (``--learning_rate 1e-6``) over it. ``--help`` after ``--config``
shows the file's values as defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pulseloco.errors import ConfigError, PulseLocoError

EXIT_CONFIG_ERROR = 2
EXIT_RUNTIME_ERROR = 1


def is_main_process() -> bool:
    """Rank 0 (or not launched by a distributed launcher), from the launcher's environment: it answers for an error
    raised before accelerate's ``PartialState`` exists, without starting a process group (which would wait for the
    other ranks)."""
    return os.environ.get("RANK", "0") == "0"


def parse_args(dataclass_types: Iterable[Any], argv: Sequence[str] | None, prog: str) -> tuple[Any, ...]:
    """The recipe's dataclasses from ``--config FILE`` and the command line.

    Raises :class:`ConfigError` (one line) for an unknown option or key, a value of the wrong type, a missing
    config file, or a value a dataclass rejects.
    """
    from trl import TrlParser

    class Parser(TrlParser):
        """TRL's parser whose ``--help`` lists ``--config`` first, then pulseloco's options (the dataclasses
        that name their group), then each library dataclass's (``GRPOConfig``, ``ModelConfig``, ...) under its
        class name, where argparse would mix them all in one list of some 300 options."""

        def __init__(self, types: list[Any], **kwargs: Any) -> None:
            self._library_groups: list[Any] = []
            super().__init__(types, **kwargs)
            self._config_group = self.add_argument_group("config file")
            self._config_group.add_argument(
                "--config",
                metavar="FILE",
                default=argparse.SUPPRESS,  # TrlParser reads and removes it before parsing
                help="A flat YAML file of these options (recipes/configs/*.yaml); flags given here override it.",
            )

        def _add_dataclass_arguments(self, dtype: Any) -> None:
            if hasattr(dtype, "_argument_group_name"):
                super()._add_dataclass_arguments(dtype)
                return
            before = set(map(id, self._optionals._group_actions))
            super()._add_dataclass_arguments(dtype)  # into the common "options" list: moved to a group of its own
            group = self.add_argument_group(f"{dtype.__name__} ({dtype.__module__.split('.')[0]})")
            for action in [a for a in self._optionals._group_actions if id(a) not in before]:
                self._optionals._group_actions.remove(action)
                group._group_actions.append(action)
            self._library_groups.append(group)

        def format_help(self) -> str:
            groups = self._action_groups
            library = [g for g in groups if any(g is lib for lib in self._library_groups)]
            ours = [g for g in groups[2:] if g is not self._config_group and g not in library]
            ours.sort(key=lambda g: not str(g.title).startswith("pulseloco"))  # stable: pulseloco's first
            self._action_groups = [self._config_group, *ours, *library, *groups[:2]]
            try:
                return super().format_help()
            finally:
                self._action_groups = groups

        def error(self, message: str) -> NoReturn:  # argparse would print the whole usage (hundreds of lines)
            raise ConfigError(f"{message} (see --help)")

    args = list(sys.argv[1:] if argv is None else argv)
    if "--config" in args:
        index = args.index("--config")
        if index + 1 >= len(args) or not Path(args[index + 1]).is_file():
            where = args[index + 1] if index + 1 < len(args) else "(missing)"
            raise ConfigError(f"--config: no such file {where}; give a YAML file such as recipes/configs/*.yaml")
    # argparse's usage line would list every option (some 250 lines before the first group)
    parser = Parser(list(dataclass_types), prog=prog, usage=f"{prog} [--config FILE] [--OPTION VALUE ...]")
    try:
        *parsed, from_config, from_command_line = parser.parse_args_and_config(
            args=args, return_remaining_strings=True, separate_remaining_strings=True
        )
    except ValueError as exc:  # HfArgumentParser and the dataclasses' __post_init__ raise ValueError
        raise ConfigError(" ".join(str(exc).split())) from None
    except Exception as exc:  # a YAML syntax error, an unreadable file
        if type(exc).__module__.startswith("yaml"):
            raise ConfigError(f"--config: not valid YAML: {' '.join(str(exc).split())}") from None
        raise
    if from_command_line:
        raise ConfigError(f"unknown option(s) {' '.join(from_command_line)} (see --help)")
    if from_config:  # TrlParser returns them as flags: ["--key", "value", ...]
        keys = [item[2:] for item in from_config if item.startswith("--")] or from_config
        raise ConfigError(f"--config: unknown key(s) {', '.join(keys)} (see --help for the options)")
    return tuple(parsed)


def check_output_dir(output_dir: str, resume_from_checkpoint: Any) -> None:
    """Refuse to start a new run in a directory that holds one (its checkpoints and logs would be mixed with or
    overwritten by the new run's). Resuming (``--resume_from_checkpoint``) is allowed."""
    path = Path(output_dir)
    if resume_from_checkpoint or not path.is_dir():
        return
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    used = sorted(p.name for p in path.iterdir() if p.name.startswith(prefix) or p.suffix in (".jsonl", ".json"))
    if used:
        raise ConfigError(
            f"output_dir {output_dir} already holds a run ({', '.join(used[:3])}); continue it with "
            "--resume_from_checkpoint true, or remove it or choose another --output_dir"
        )


TENSORBOARD_SUBDIR = "tensorboard"
"""Where the recipes' TensorBoard event files go, under ``output_dir`` (unless ``TENSORBOARD_LOGGING_DIR`` is set)."""


@contextlib.contextmanager
def tensorboard_logging_dir(output_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Build the Trainer inside this block so that, with ``report_to: tensorboard``, its event files go to
    ``<output_dir>/tensorboard`` (a resumed run appends there: one continuous curve); yields that directory.

    transformers 5 has no ``logging_dir`` argument any more: its ``TensorBoardCallback`` reads the environment
    variable ``TENSORBOARD_LOGGING_DIR`` when the Trainer makes it, else writes to
    ``<output_dir>/runs/<date>_<host>`` (a new directory per start). The variable is set for the block only (a
    process that builds several Trainers, as the tests do, gets each its own directory) and a value the user set
    wins (yielded then). Never raises."""
    given = os.environ.get("TENSORBOARD_LOGGING_DIR")
    if given:
        yield Path(os.path.expanduser(given))
        return
    target = Path(output_dir) / TENSORBOARD_SUBDIR
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(target)
    try:
        yield target
    finally:
        os.environ.pop("TENSORBOARD_LOGGING_DIR", None)


def quiet_libraries() -> None:
    """Keep peer logs readable: no per-file progress bars of transformers ("Loading weights", "Writing model
    shards") and none of the deprecation warnings TRL triggers inside transformers on every run."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.*deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*deprecated", category=FutureWarning)


def end_process_group() -> None:
    """Tear down the ``torch.distributed`` group of a multi-process launch before the interpreter exits.

    A gloo group left to the interpreter's shutdown can abort the process ("terminate called without an active
    exception", SIGABRT) after the run has finished and saved; the launcher then reports the run as failed.
    accelerate's :class:`PartialState` (the recipe's own) waits for every rank to finish its last collective, then
    destroys the group. Does nothing for a single process or one that never initialized a group.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    from accelerate import PartialState

    state = PartialState()
    state.wait_for_everyone()
    state.destroy_process_group()


def run_recipe(prog: str, main: Callable[[], None]) -> None:
    """Run ``main``; a failure the project names ends the process with one line on stderr: exit code 2 for a
    bad configuration (:class:`ConfigError`), 1 for a failure at run time (the swarm unreachable, a timeout,
    out of memory)."""
    try:
        quiet_libraries()
        main()
        end_process_group()
    except ConfigError as exc:
        if is_main_process():
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    except PulseLocoError as exc:
        if is_main_process():
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_RUNTIME_ERROR) from None
    except MemoryError:
        if is_main_process():
            print(f"{prog}: error: out of memory; use a smaller model or batch size", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_RUNTIME_ERROR) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
