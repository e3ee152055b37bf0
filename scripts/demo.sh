#!/usr/bin/env bash
# Sets up .venv (scripts/_setup.sh), makes or reuses a small warm model, then runs a PULSELoCo + PULSESync GRPO
# swarm on 127.0.0.1 with TRL's GRPOTrainer, whose completions all come from a rollout worker, and prints a table.
#
#   scripts/demo.sh                   the swarm demo (first run: about 1.5 minutes more to make the warm model)
#   scripts/demo.sh --out DIR         put the logs and metrics in DIR (default runs/demo-<date>, wiped first)
#   scripts/demo.sh --steps N         GRPO optimizer steps per peer (default 96; a multiple of 8, the inner steps)
#   scripts/demo.sh --timeout S       stop everything after S seconds (default 900)
#   scripts/demo.sh --seed N          the trainers' seeds are N and N + 1 (default 0): their prompts and samples
#   scripts/demo.sh --engine E        the rollout worker's engine: transformers (default) or vllm
#   scripts/demo.sh --warm-size S     the warm model (scripts/warm_model.py --size S; default demo; wide: the RL-rate
#                                     regime's, about 9 minutes to make the first time)
#   scripts/demo.sh -- ARGS           ARGS to both trainers' recipes/grpo.py, after the demo's own (they win), for
#                                     example -- --learning_rate 3e-6
#   scripts/demo.sh --codec [ARGS]    the codec benchmark instead: experiments/codec/bench_codec.py ARGS
#                                     (for example --codec --small for a quick run)
#
# What runs, all on 127.0.0.1, each in its own process group:
#   0. scripts/warm_model.py --size demo: a small Llama pretrained on local text, then taught the task's format
#      (cached under ~/.cache/pulseloco, or $PULSELOCO_CACHE; later runs reuse it)
#   1. a bootstrap node: `pulseloco dht`
#   2. two GRPO trainer peers: `accelerate launch recipes/grpo.py --config recipes/configs/grpo-demo.yaml
#      --strategy pulseloco --rollouts swarm --rollout_fallback wait --per_device_train_batch_size 256`
#      (32 prompts x 8 completions per step): they generate nothing themselves, every
#      completion comes from the rollout worker; peer 0 publishes a version with PULSESync after every optimizer
#      step (--publish_every 1: the consensus after each round, its own weights between rounds, so that the
#      rollouts are at most a step or two behind the trainers), signed with a key made by `pulseloco keygen` in a
#      temporary directory (removed on exit, never written to the repo)
#   3. one rollout worker: `recipes/rollout_worker.py --serve_rollouts`, following the published versions until
#      the last one and generating the trainers' completions with them, with transformers computing in FP32 on
#      the published BF16 weights (on 2 CPU cores 96 steps train in about 2 minutes this way; vLLM's CPU build in
#      BF16, --engine vllm, which scripts/_setup.sh installs unless PULSELOCO_VLLM=none, took twice as long)
# Then scripts/demo_report.py prints what RL gained (greedy reward before and after on the task's 100 problems, with
# standard errors, and the sampled reward), bytes sent against DiLoCo and DDP (and whether the run was in PULSE's
# sparse regime: at the demo's learning rate it is not), patch bytes
# against full BF16 checkpoints, the rollouts per worker with their version lag, and whether every digest matched.
# Everything started is stopped on exit, Ctrl-C or SIGTERM. Needs no stdin; exits non-zero if a process failed or
# a digest did not match.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"

if [[ "${1:-}" == "--codec" ]]; then
    shift
    exec "$PYTHON" experiments/codec/bench_codec.py "$@"
fi

OUT="runs/demo-$(date +%Y%m%d)"
STEPS=96
TIMEOUT=900
SEED=0
ENGINE=transformers
WARM_SIZE=demo
TRAINER_EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --warm-size) WARM_SIZE="$2"; shift 2 ;;
        --) shift; TRAINER_EXTRA=("$@"); break ;;
        --out) OUT="$2"; shift 2 ;;
        --steps) STEPS="$2"; shift 2 ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --seed) SEED="$2"; shift 2 ;;
        --engine) ENGINE="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^[^#]/{/^#/p;}' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "demo.sh: error: unknown option $1 (see scripts/demo.sh --help)" >&2; exit 2 ;;
    esac
done

CONFIG=recipes/configs/grpo-demo.yaml
RUN_ID="demo-$$"
INNER_STEPS=8
if ! [[ "$STEPS" =~ ^[0-9]+$ ]] || (( STEPS == 0 || STEPS % INNER_STEPS )); then
    echo "demo.sh: error: --steps must be a positive multiple of $INNER_STEPS, got $STEPS" >&2
    exit 2
fi
if [[ "$ENGINE" != transformers && "$ENGINE" != vllm ]]; then
    echo "demo.sh: error: --engine must be transformers or vllm, got $ENGINE" >&2
    exit 2
fi
if [[ "$ENGINE" == vllm ]] && ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
    echo "demo.sh: error: --engine vllm, but vLLM is not installed in $VENV (scripts/_setup.sh installs it unless PULSELOCO_VLLM=none)" >&2
    exit 2
fi
if ! [[ "$SEED" =~ ^[0-9]+$ ]]; then
    echo "demo.sh: error: --seed must be a non-negative integer, got $SEED" >&2
    exit 2
fi
ROUNDS=$(( STEPS / INNER_STEPS ))
LAST_VERSION=$(( STEPS + 1 ))  # version 1 is the starting model, then one per optimizer step (--publish_every 1)

# Idempotent: the output directory is recreated (metrics files are appended to, so old ones must go).
rm -rf "$OUT"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
KEYS="$(mktemp -d "${TMPDIR:-/tmp}/pulseloco-demo-keys.XXXXXX")"

export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 TQDM_DISABLE=1
PGIDS=()

stop_all() {
    local pgid
    for pgid in "${PGIDS[@]}"; do kill -TERM -- "-$pgid" 2>/dev/null || true; done
    for _ in $(seq 50); do
        local alive=0
        for pgid in "${PGIDS[@]}"; do kill -0 -- "-$pgid" 2>/dev/null && alive=1; done
        (( alive )) || break
        sleep 0.2
    done
    for pgid in "${PGIDS[@]}"; do kill -KILL -- "-$pgid" 2>/dev/null || true; done
    PGIDS=()
}
on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    stop_all
    rm -rf "$KEYS"
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say() { echo "[demo $(date +%H:%M:%S)] $*" >&2; }

# start NAME CMD...: run CMD in a new session (its own process group, so that stop_all reaches its children:
# accelerate's worker process, hivemind's DHT process and libp2p daemon), output to $OUT/NAME.log, no stdin.
start() {
    local name="$1"
    shift
    setsid "$@" >"$OUT/$name.log" 2>&1 </dev/null &
    PGIDS+=("$!")
    eval "PID_$name=$!"
}

# wait_for_line NAME REGEX SECONDS: print the first match of REGEX in NAME's log (extended regex).
wait_for_line() {
    local name="$1" regex="$2" deadline=$((SECONDS + $3)) pid_var="PID_$1"
    while (( SECONDS < deadline )); do
        if grep -m1 -oE "$regex" "$OUT/$name.log" 2>/dev/null; then return 0; fi
        kill -0 "${!pid_var}" 2>/dev/null || break
        sleep 0.5
    done
    say "error: $name did not print /$regex/; last lines of $OUT/$name.log:"
    tail -n 20 "$OUT/$name.log" >&2
    return 1
}

# wait_exit NAME DEADLINE: wait until NAME exits or SECONDS reaches DEADLINE; returns its exit code (124: timeout).
wait_exit() {
    local pid_var="PID_$1"
    local pid="${!pid_var}"
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < $2 )); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        say "error: $1 still running after the ${TIMEOUT}s budget (--timeout); stopping it"
        return 124
    fi
    local rc=0
    wait "$pid" || rc=$?
    return "$rc"
}

BEGIN=$SECONDS
DEADLINE=$((SECONDS + TIMEOUT))
say "output: $OUT"
say "warm model: making or reusing it (scripts/warm_model.py --size $WARM_SIZE; minutes the first time)"
"$PYTHON" scripts/warm_model.py --size "$WARM_SIZE" >"$OUT/warm_model.log" 2>&1 || {
    say "error: scripts/warm_model.py failed; last lines of $OUT/warm_model.log:"; tail -n 20 "$OUT/warm_model.log" >&2
    exit 1
}
MODEL="$(tail -n 1 "$OUT/warm_model.log" | sed -n 's/^warm model: //p')"
[[ -n "$MODEL" && -d "$MODEL" ]] || { say "error: no model directory in $OUT/warm_model.log"; exit 1; }
say "warm model: $MODEL"
pulseloco keygen --out "$KEYS/publisher" >"$OUT/keygen.log"

start bootstrap pulseloco dht --host-maddrs /ip4/127.0.0.1/tcp/0
BOOTSTRAP="$(wait_for_line bootstrap '/ip4/127\.0\.0\.1/tcp/[0-9]+/p2p/[A-Za-z0-9]+' 120)"
say "bootstrap node: $BOOTSTRAP"

ENGINE_ARGS=(--engine "$ENGINE")
start worker "$PYTHON" recipes/rollout_worker.py --model_name_or_path "$MODEL" --run_id "$RUN_ID" \
    --initial_peers "$BOOTSTRAP" --public_key "$KEYS/publisher.pub" --until_version "$LAST_VERSION" \
    --max_seconds "$TIMEOUT" --output_dir "$OUT/worker" --serve_rollouts "${ENGINE_ARGS[@]}"
# the worker follows from the first version: it is ready (vLLM takes a while to start) before the trainers start
wait_for_line worker 'rollout: following' 300 >/dev/null
LAUNCH=(accelerate launch -q --config_file recipes/accelerate_configs/single_process.yaml)
PEER_ARGS=(recipes/grpo.py --config "$CONFIG" --model_name_or_path "$MODEL" --strategy pulseloco --run_id "$RUN_ID"
    --initial_peers "$BOOTSTRAP" --target_group_size 2 --matchmaking_time 60 --max_steps "$STEPS"
    --rollouts swarm --rollout_fallback wait --per_device_train_batch_size 256)
# 32 prompts x 8 completions per step, twice the config's (which experiments/compare/compare.py measures with): a
# larger and steadier greedy gain in about the same time, since a step's cost here is mostly the version round trip,
# not the batch (the runs: docs/log.md)
# peer 0 lingers after its last round so that the rollout worker can fetch the last version from it
start peer0 "${LAUNCH[@]}" "${PEER_ARGS[@]}" --seed "$SEED" --output_dir "$OUT/peer0" --linger 20 \
    --publish --publish_every 1 --signing_key "$KEYS/publisher" ${TRAINER_EXTRA[@]+"${TRAINER_EXTRA[@]}"}
start peer1 "${LAUNCH[@]}" "${PEER_ARGS[@]}" --seed "$((SEED + 1))" --output_dir "$OUT/peer1" --linger 5 \
    --public_key "$KEYS/publisher.pub" ${TRAINER_EXTRA[@]+"${TRAINER_EXTRA[@]}"}
say "started 2 PULSELoCo GRPO peers ($STEPS steps = $ROUNDS rounds each) fed by a rollout worker" \
    "(${ENGINE_ARGS[1]}, until version $LAST_VERSION); logs: $OUT/{peer0,peer1,worker,bootstrap}.log"

failed=()
for name in peer0 peer1 worker; do
    rc=0
    wait_exit "$name" "$DEADLINE" || rc=$?
    if (( rc != 0 )); then
        failed+=("$name")
        say "error: $name exited with $rc; last lines of $OUT/$name.log:"
        tail -n 15 "$OUT/$name.log" >&2
    else
        say "$name finished"
    fi
done
stop_all
say "all processes stopped after $((SECONDS - BEGIN)) s"

report_rc=0
"$PYTHON" scripts/demo_report.py "$OUT" --seconds "$((SECONDS - BEGIN))" --json "$OUT/report.json" || report_rc=$?
say "curves (loss, reward, rollouts/*, pulseloco/* per round, pulsesync/* per version) of both peers:" \
    "tensorboard --logdir $OUT  (event files in $OUT/peer*/tensorboard)"
if (( ${#failed[@]} )); then
    say "failed: ${failed[*]} (logs in $OUT)"
    exit 1
fi
exit "$report_rc"
