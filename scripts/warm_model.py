"""Make a small warm (pretrained, then supervised) causal LM in Hugging Face format, and cache it.

    python scripts/warm_model.py --size demo                # built once (minutes), then reused at once
    python scripts/warm_model.py --size tiny --cache-dir /tmp/cache --force
    MODEL=$(python scripts/warm_model.py --size demo | tail -n 1 | sed 's/^warm model: //')

The command line of :mod:`harness.warm` (scripts/harness/warm.py: the sizes, the two training phases, the cache).
PULSE's observation holds for *pretrained* weights; offline there are none to download, so this script makes
them. The last line of stdout is ``warm model: <absolute path>``: a directory that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load, and a ``model_name_or_path``
for ``recipes/grpo.py`` and ``recipes/pretrain.py``.

The model goes to ``<cache>/models/warm-<size>-<hash>`` (cache: ``--cache-dir``, else ``$PULSELOCO_CACHE``, else
``~/.cache/pulseloco``); the hash covers every setting that affects the weights. A build is moved into place only
when complete (``pulseloco_warm.json`` written last); concurrent calls for the same model wait for one build.
Exit codes: 0 with the model's directory as the last line; 2 (one line ``warm_model.py: error: ...`` on stderr)
when the cache directory cannot be written; 130 on Ctrl-C and 128 + N on signal N (SIGTERM), the half-built
directory removed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from harness.warm import PROG, SIZES, BuildError, read_marker, request_stop, say, warm_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; argparse exits 2 with a usage line on a bad flag."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        required=True,
        help="smallest first: tiny (0.12M parameters, the tests'; under a minute alone, longer beside other "
        "work), demo (1.64M, scripts/demo.sh; about 1.5 min), wide (9.18M, the sparse regime), compare (9.5M, "
        "experiments/compare; about 12 min), each on 2 CPU cores",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache directory (default: $PULSELOCO_CACHE, else ~/.cache/pulseloco); models go to <cache>/models",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete model is cached")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Build or reuse the model and print its directory last; exits as the module docstring says."""
    args = parse_args(argv)
    started = time.monotonic()
    # a terminated build (Ctrl-C, or SIGTERM from a supervisor) removes its temporary directory on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: request_stop(128 + signum))
    try:
        path = warm_model(args.size, cache_dir=args.cache_dir, force=args.force, threads=args.threads)
    except BuildError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    marker = read_marker(path)
    say(
        f"{args.size}: reward {marker['reward']:.3f} (greedy, on {marker['num_eval_problems']} "
        f"{marker['task']} problems, operands 0..{marker['max_operand']}), {time.monotonic() - started:.1f} s"
    )
    print(f"warm model: {path}", flush=True)


if __name__ == "__main__":
    from pulseloco.integrations import skip_vllm_import

    skip_vllm_import()  # TRL would import vLLM (seconds of CPU); this process never uses it
    main()
