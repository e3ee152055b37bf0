"""``python -m pulseloco.cli``: the same as the ``pulseloco`` command."""

from pulseloco.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
