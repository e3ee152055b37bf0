#!/usr/bin/env bash
# Lint and test pulseloco: sets up .venv (scripts/_setup.sh), runs ruff, mypy, then pytest.
# Arguments go to pytest, e.g. `scripts/test.sh -k cli -x`.
# Tests run in parallel (pytest-xdist), one worker per core up to 4, each test file on one worker, the slowest files
# first (tests/conftest.py). PULSELOCO_TEST_WORKERS=N sets the number of workers; 0 runs everything in this process.
# Each process the tests start computes on one thread (OMP_NUM_THREADS=1, unless set): the workers already keep the
# cores busy, and torch's thread pools competing for the same cores cost CPU time in spinning.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"

lint_dirs=()
for dir in pulseloco tests scripts experiments recipes; do
    [[ -d "$dir" ]] && lint_dirs+=("$dir")
done
echo "[test] ruff check ${lint_dirs[*]}" >&2
ruff check --quiet "${lint_dirs[@]}"

echo "[test] mypy" >&2
"$VENV/bin/mypy"  # pinned in the test extra; settings (packages = pulseloco) in pyproject.toml

echo "[test] pytest" >&2
# Bytecode: the suite starts well over a hundred Python processes that import pulseloco, scripts/harness and the
# tests' helpers. With PYTHONDONTWRITEBYTECODE set (as on some CI images) none of them would cache what it compiled,
# so each would compile those sources again (about 0.5 CPU-s per process), and each xdist worker would rewrite
# every test module's asserts again. Compile once here and let the processes cache the rest (__pycache__ is
# ignored by git).
unset PYTHONDONTWRITEBYTECODE
"$PYTHON" -m compileall -q -j 0 pulseloco scripts experiments tests recipes >/dev/null
rc=0
workers="${PULSELOCO_TEST_WORKERS:-auto}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$PYTHON" -m pytest -q --durations=15 -n "$workers" --maxprocesses 4 --dist loadfile --no-loadscope-reorder "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "[test] error: pytest collected no tests" >&2
fi
exit "$rc"
