#!/usr/bin/env bash
# One GPU machine, one command, under 8 minutes: CUDA/NCCL sanity, NVML as the cost guard and
# MLflow read it, ResNet-50 bf16 images/s, the checkpoint staging ratio on CUDA, and a
# preempt-and-resume on CUDA, once with the rank exec'd and once forked from the warm launcher.
# Writes one results file, gpu_check.json (with gpu_check.log beside it), into OUT_DIR: the first argument, else $OUT (the device tool's folder), else
# benchmarks/out/gpu. Prints a summary table last; exits 1 if any step failed.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#   bash benchmarks/gpu_check.sh --cpu [OUT_DIR]        # check the script here, without CUDA
#   bash benchmarks/gpu_check.sh --fetch-wheels DIR     # here: wheels the GPU machine lacks
#
# Python: $PYTHON, else python3 (on the lent H200 machine, the one holding PyTorch). Stoker's
# pure-Python needs missing there (pydantic, tenacity, ...) are installed with
# `pip install --target` into $STOKER_SITE (default /tmp/stoker-site) from the wheels in
# $WHEELS (default .whl, carried with the run), else from the index when one is reachable.
# Every step runs under `timeout`, within an overall budget ($BUDGET_S, default 450 s), so one
# hung step cannot eat the rest.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
SITE="${STOKER_SITE:-/tmp/stoker-site}"
BUDGET_S="${BUDGET_S:-450}"
IMPORTS="torch,pydantic,pydantic_core,annotated_types,typing_inspection,tenacity,yaml,fsspec"
IMPORTS+=",psutil,numpy,scipy,pynvml"
WHEEL_REQS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions tenacity)

CPU=""
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  dest="${2:?--fetch-wheels needs a folder}"
  mkdir -p "$dest"
  # Pin what this checkout's environment runs, so the GPU machine runs the same versions.
  mapfile -t pins < <("$PY" - "${WHEEL_REQS[@]}" <<'PYEOF'
import importlib.metadata as m, sys
for name in sys.argv[1:]:
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        print(name)
PYEOF
)
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "${pins[@]}"
fi
if [[ "${1:-}" == "--cpu" ]]; then CPU="--cpu"; shift; fi
OUT_DIR="${1:-${OUT:-$ROOT/benchmarks/out/gpu}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
STEPS="$(mktemp -d /tmp/stoker-gpu-check.XXXXXX)"
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
START=$SECONDS
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1

say() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }

# step NAME TIMEOUT_S CMD...: runs CMD under timeout (capped by what is left of the budget),
# keeping its output (NAME.out), exit code (NAME.rc) and seconds (NAME.s) for the summary.
step() {
  local name="$1" limit="$2"; shift 2
  local left=$((BUDGET_S - (SECONDS - START)))
  (( limit > left )) && limit=$left
  if (( limit < 15 )); then
    say "$name: skipped, the budget is spent"
    echo '{"status": "skipped", "reason": "the overall budget was spent"}' >"$STEPS/$name.out"
    echo 0 >"$STEPS/$name.rc"; echo 0 >"$STEPS/$name.s"
    return
  fi
  say "$name: $* (timeout ${limit} s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$STEPS/$name.out" 2>&1
  echo $? >"$STEPS/$name.rc"
  echo $((SECONDS - t0)) >"$STEPS/$name.s"
  { echo "----- $name (exit $(cat "$STEPS/$name.rc"))"; cat "$STEPS/$name.out"; } >>"$LOG"
  say "$name: exit $(cat "$STEPS/$name.rc") after $(cat "$STEPS/$name.s") s"
}

setup() {
  # Everything Stoker's runtime and the benchmarks import, beside torch from the machine.
  if "$PY" -c "import $IMPORTS" 2>/dev/null; then
    echo "all imports present"; return 0
  fi
  mkdir -p "$SITE"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    timeout 100 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" "$WHEELS"/*.whl || return 1
  else
    echo "no wheels in $WHEELS: trying the package index"
    timeout 100 "$PY" -m pip install -q --no-compile --target "$SITE" "${WHEEL_REQS[@]}" \
      || return 1
  fi
  "$PY" -c "import $IMPORTS"
}

# record NAME CMD...: runs a shell function as a step (timeout cannot run functions: the
# function guards its own slow commands).
record() {
  local name="$1"; shift
  local t0=$SECONDS
  "$@" >"$STEPS/$name.out" 2>&1
  echo $? >"$STEPS/$name.rc"
  echo $((SECONDS - t0)) >"$STEPS/$name.s"
  { echo "----- $name (exit $(cat "$STEPS/$name.rc"))"; cat "$STEPS/$name.out"; } >>"$LOG"
  say "$name: exit $(cat "$STEPS/$name.rc") after $(cat "$STEPS/$name.s") s"
}

export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 2
say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
record setup setup
nvidia-smi >>"$LOG" 2>&1 || say "nvidia-smi: not available"

if [[ -n "$CPU" ]]; then  # the same steps at toy sizes, on the CPU
  RESNET=(--allow-cpu --model small_cnn --image-size 32 --batch-size 8 --steps-per-epoch 4
          --repeats 1 --warmups 0)
  CKPT=(--device cpu --size-mb 4 --repeats 2 --warmups 1)
else
  RESNET=(--batch-size 128 --steps-per-epoch 30 --repeats 2 --warmups 0)
  CKPT=(--device cuda --size-mb 400 --repeats 5 --warmups 1)
fi
step sanity 90 "$PY" benchmarks/gpu_check.py sanity $CPU
step nvml 60 "$PY" benchmarks/gpu_check.py nvml $CPU
step checkpoint 90 "$PY" benchmarks/bench_checkpoint.py "${CKPT[@]}"
step preempt 150 "$PY" benchmarks/gpu_check.py preempt $CPU
# The same with the rank forked from the warm launcher (the default only without a GPU device):
# CUDA must come up in a forked rank whose parent imported torch and torch._dynamo.
step preempt_fork 120 env STOKER_WORKER_START=fork "$PY" benchmarks/gpu_check.py preempt $CPU
step resnet 240 "$PY" benchmarks/bench_gpu_resnet.py "${RESNET[@]}"

"$PY" benchmarks/gpu_check.py summarize "$STEPS" "$OUT_DIR/gpu_check.json" | tee -a "$LOG"
code=${PIPESTATUS[0]}
say "done in $((SECONDS - START)) s; results $OUT_DIR/gpu_check.json"
rm -rf "$STEPS"
exit "$code"
