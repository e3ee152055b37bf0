#!/usr/bin/env bash
# Sets up .venv (scripts/_setup.sh), then runs the codec benchmark on a real model update and prints a table.
# Arguments go to scripts/bench_codec.py (see its --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
exec "$PYTHON" scripts/bench_codec.py "$@"
