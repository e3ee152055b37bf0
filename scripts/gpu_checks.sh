#!/usr/bin/env bash
# The GPU checks in one run, each under its own time limit, for a machine with one CUDA GPU (README "On a GPU").
#
#     bash scripts/gpu_checks.sh OUT_DIR [WARM_MODEL_DIR]
#
# PY picks the interpreter (default: .venv/bin/python, which scripts/test.sh makes; a machine whose own python3
# already holds torch, transformers and accelerate can run with PY=python3 and the rest on PYTHONPATH). Writes
# OUT_DIR/gpu_checks.log and the benchmarks' JSON; a step that fails or runs out of time is reported in the log and
# the next one still runs. The exit status is the number of failed steps. WARM_MODEL_DIR: the demo's warm model for
# the rollout check (default: built by scripts/warm_model.py --size demo, a few minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [WARM_MODEL_DIR]}
mkdir -p "$out"
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
log="$out/gpu_checks.log"
failed=0

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 started rc
    shift 2
    started=$(date +%s)
    echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $(($(date +%s) - started))s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$log"
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
"cuda", torch.cuda.is_available())' 2>&1 | tee -a "$log"

step cuda-tests 150 "$PY" -m pytest -q -p no:cacheprovider --timeout 140 \
    tests/test_codec_parallel.py tests/test_rollout_shadow.py tests/test_loco_placement.py
model=${2:-}
if [ -z "$model" ]; then
    model=$("$PY" scripts/warm_model.py --size demo | tail -n 1)
    model=${model#warm model: }
fi
step verify-cuda 120 "$PY" scripts/bench_verify.py --engines transformers --device cuda --model_name_or_path "$model" \
    --prompts 128 --samples 8 --max-new-tokens 8 --out "$out/verify-cuda"
step verify-cuda-worker-cpu-trainer 120 "$PY" scripts/bench_verify.py --engines transformers --device cuda \
    --trainer-device cpu --model_name_or_path "$model" --prompts 128 --samples 8 --max-new-tokens 8 \
    --out "$out/verify-cuda-cpu"
step codec-1b 180 "$PY" experiments/codec/bench_codec.py --model 1b --device cuda --lrs 1e-6 --steps 1 \
    --densities 0.01,0.1 --codecs pulseloco-abs,pulseloco-delta --json "$out/bench_codec_1b_cuda.json"
step loco-1b 300 "$PY" scripts/bench_loco.py --device cuda --num-peers 2 --rounds 2 --inner-steps 4 --hidden 2048 \
    --layers 22 --heads 32 --vocab 32000 --seq-len 256 --batch 2 --selectors pulse dense --lrs 3e-6 \
    --matchmaking-time 5 --timeout 140 --json "$out/bench_loco_1b_cuda.json"
echo "=== $failed step(s) failed" | tee -a "$log"
exit "$failed"
