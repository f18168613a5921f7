#!/usr/bin/env bash
# gdngen's prepared run on a lent NVIDIA H100/H200 (docs/DEVICE.md): from the source tree, with
# the wheels of `make device-wheels` carried in .device-wheels/, in about 8.5 minutes:
#
#   install   the carried wheels (optuna & co., fla) into a folder on PYTHONPATH; gdngen itself
#             runs from the tree (PYTHONPATH), so the image's jax, torch and triton stay as they are
#   env       versions, the attached device, whether fla imports
#   battery   the pallas_gpu validation battery compiled by Triton, float32 and bfloat16, against
#             the float64 reference (benchmarks/device/steps.py battery)
#   tune-qwen `gdngen tune --device h100|h200` for Qwen3-Next heads (Hk=16, Hv=32, D=128, bf16,
#             T=4096), a small trial budget
#   tune-kimi the same for Kimi-Linear heads (per-channel gates)
#   compare   forward and forward+backward of the tuned variants against fla's
#             chunk_gated_delta_rule / chunk_kda at FlashQLA's published H200 shapes
#
# Every step runs under `timeout` (its box, cut to what is left of TOTAL_S); a failed or timed-out
# step is recorded and the next one runs. $OUT gets: nvidia.log (everything printed),
# results.json (every step's outcome and data), summary.md, tuned/<device>.json (the tuned file),
# rewritten after each step, so a run cut short still brings back what it did.
#
#   benchmarks/device/nvidia.sh              # on the device (run tool); $OUT is set there
#   benchmarks/device/nvidia.sh --dry-run    # here: CPU, Pallas interpret mode, toy sizes
#   benchmarks/device/nvidia.sh --plan       # print the steps and their boxes, run nothing
#
# Environment: DRY_RUN=1 (as --dry-run), OUT, PYTHON (default python3), DEVICE (default from
# nvidia-smi; h200 in a dry run), STEPS (comma-separated subset, e.g. STEPS=compare after a
# partial run on a still-warm machine), TOTAL_S, BOX_<STEP> (seconds, e.g. BOX_COMPARE=115),
# TRIALS_QWEN, TRIALS_KIMI, TRIAL_TIMEOUT, WHEELS (default .device-wheels), WORK.
set -u -o pipefail

DRY_RUN=${DRY_RUN:-0}
PLAN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --plan) PLAN=1 ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "nvidia.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STEPS_PY="$REPO/benchmarks/device/steps.py"
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$REPO/.device-wheels}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gdngen-device.XXXXXX")}
OUT=${OUT:-$WORK/out}
STEPS=${STEPS:-install,env,battery,tune-qwen,tune-kimi,compare}
TUNED="$WORK/tuned"
mkdir -p "$WORK" "$OUT" "$TUNED" "$WORK/cache"

if [ "$DRY_RUN" = 1 ]; then
  # CPU only: Pallas interpret mode stands in for Triton on the GPU; toy heads, a few cases
  TOTAL_S=${TOTAL_S:-1800}
  : "${BOX_INSTALL:=120}" "${BOX_ENV:=120}" "${BOX_BATTERY:=420}" "${BOX_TUNE_QWEN:=420}"
  : "${BOX_TUNE_KIMI:=420}" "${BOX_COMPARE:=300}"
  : "${TRIALS_QWEN:=2}" "${TRIALS_KIMI:=2}" "${TRIAL_TIMEOUT:=240}"
  BATTERY_ARGS=(--cases t1,short --jobs 2)
  TUNE_EXTRA=(--cases t1)
  COMPARE_ARGS=(--repeats 2 --warmup 1 --dry-run)
  DRY=(--dry-run)
  GDNGEN=("$PY" "$STEPS_PY" offdevice)  # `gdngen` without the attached-device check
  DEVICE=${DEVICE:-h200}
  export GDNGEN_INTERPRET=1 JAX_PLATFORMS=cpu
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  # the run tool's timeout_s is 570: TOTAL_S leaves a minute for the last summary and transfers
  TOTAL_S=${TOTAL_S:-500}
  : "${BOX_INSTALL:=20}" "${BOX_ENV:=30}" "${BOX_BATTERY:=100}" "${BOX_TUNE_QWEN:=135}"
  : "${BOX_TUNE_KIMI:=105}" "${BOX_COMPARE:=110}"
  : "${TRIALS_QWEN:=6}" "${TRIALS_KIMI:=4}" "${TRIAL_TIMEOUT:=60}"
  BATTERY_ARGS=(--jobs 6)
  TUNE_EXTRA=()
  COMPARE_ARGS=()
  DRY=()
  GDNGEN=("$PY" -m gdngen)
  export PYTHONPATH="$REPO:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  # jax takes GPU memory as it needs it, leaving room for torch (fla) in the compare step;
  # compiled programs are kept across the steps' processes
  export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR="$WORK/jax-cache"
  if [ -z "${DEVICE:-}" ]; then
    gpu=$(timeout 20 nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | head -n 1)
    case "${gpu,,}" in
      *h200*) DEVICE=h200 ;;
      *h100*) DEVICE=h100 ;;
      *) DEVICE=unknown; echo "error: nvidia-smi names no H100/H200 ($gpu); set DEVICE" ;;
    esac
  fi
fi
export GDNGEN_CACHE_DIR="$WORK/cache" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

START=$(date +%s)
DEADLINE=$((START + TOTAL_S))

if [ "$PLAN" = 0 ]; then
  exec > >(tee -a "$OUT/nvidia.log") 2>&1
  TEE_PID=$!
fi

echo "gdngen device run: device=$DEVICE dry_run=$DRY_RUN total=${TOTAL_S}s steps=$STEPS"
echo "repo=$REPO work=$WORK out=$OUT python=$PY ($("$PY" --version 2>&1))"
echo "git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no .git (tree copy)')"

wanted() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

record() {  # record STEP RC SECONDS BOX [NOTE]
  [ "$PLAN" = 1 ] && return 0
  "$PY" "$STEPS_PY" record --work "$WORK" --step "$1" --rc "$2" --seconds "$3" --box "$4" \
    --note "${5:-}"
}

summarize() {
  [ "$PLAN" = 1 ] && return 0
  mkdir -p "$OUT/tuned"
  if [ -f "$TUNED/$DEVICE.json" ]; then cp "$TUNED/$DEVICE.json" "$OUT/tuned/$DEVICE.json"; fi
  "$PY" "$STEPS_PY" summary --work "$WORK" --out "$OUT" --device "$DEVICE" \
    --tuned-dir "$TUNED" >/dev/null 2>"$WORK/summary.err" \
    || { echo "summary failed:"; cat "$WORK/summary.err"; }
}

step() {  # step NAME BOX CMD...: time-boxed; its outcome recorded, the summary rewritten
  local name=$1 box=$2
  shift 2
  local left=$((DEADLINE - $(date +%s) - 5))
  if ! wanted "$name"; then
    record "$name" skipped 0 "$box" "not in STEPS"
    return 0
  fi
  if [ "$box" -gt "$left" ]; then box=$left; fi
  if [ "$box" -lt 5 ]; then
    echo "=== [$name] skipped: no time left of TOTAL_S=${TOTAL_S}s"
    record "$name" skipped 0 "$box" "no time left"
    return 0
  fi
  echo
  echo "=== [$name] $(date -u +%T) box ${box}s: $*"
  if [ "$PLAN" = 1 ]; then return 0; fi
  local t0 rc dt
  t0=$(date +%s%N)
  timeout -k 10 "$box" "$@"
  rc=$?
  dt=$(( ($(date +%s%N) - t0) / 10000000 ))
  dt="$((dt / 100)).$(printf %02d $((dt % 100)))"
  echo "=== [$name] rc=$rc after ${dt}s$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo ' (TIMED OUT)')"
  record "$name" "$rc" "$dt" "$box"
  summarize
}

# ---- install: the carried wheels, without touching the image's packages
if [ "$DRY_RUN" = 1 ]; then
  # unpack them for the device's Python 3.12 (not importable here: a check that the set is
  # complete and installs); this venv's own optuna is used
  step install "$BOX_INSTALL" "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target "$WORK/site-py312" --python-version 3.12 --implementation cp \
    --only-binary=:all: --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 "$WHEELS"/*.whl
else
  step install "$BOX_INSTALL" "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target "$WORK/site" "$WHEELS"/*.whl
fi

# ---- env: versions, the device jax sees, whether fla imports
step env "$BOX_ENV" "$PY" "$STEPS_PY" env --out "$WORK/env.json" --device "$DEVICE" "${DRY[@]}"

# ---- (a) the battery, Triton-compiled (interpret mode in a dry run), float32 and bfloat16
step battery "$BOX_BATTERY" "$PY" "$STEPS_PY" battery --out "$WORK/battery.json" \
  --dtypes float32,bfloat16 --budget-s $((BOX_BATTERY - 15)) "${BATTERY_ARGS[@]}"

# ---- (b) a short tune per model: search budget = box - trial timeout - confirmation margin
tune_step() {  # tune_step STEP MODEL BOX TRIALS
  local box=$3 search
  search=$((box - TRIAL_TIMEOUT - 25))
  if [ "$search" -lt 10 ]; then search=10; fi
  # shellcheck disable=SC2046
  step "$1" "$box" "${GDNGEN[@]}" tune --device "$DEVICE" \
    $("$PY" "$STEPS_PY" tune-args "$2" "${DRY[@]}") --trials "$4" --timeout "$search" \
    --trial-timeout "$TRIAL_TIMEOUT" --repeats 3 --no-crossover "${TUNE_EXTRA[@]}" \
    --storage "$WORK/tune.journal" --cache-dir "$TUNED"
}
tune_step tune-qwen qwen3-next "$BOX_TUNE_QWEN" "$TRIALS_QWEN"
tune_step tune-kimi kimi-linear "$BOX_TUNE_KIMI" "$TRIALS_KIMI"

# ---- (c) the tuned variants against fla; first-use validation off (steps a and b checked them)
step compare "$BOX_COMPARE" env GDNGEN_VALIDATE=off "$PY" "$STEPS_PY" compare \
  --device "$DEVICE" --tuned-dir "$TUNED" --out "$WORK/compare.json" \
  --budget-s $((BOX_COMPARE - 30)) "${COMPARE_ARGS[@]}"

# ---- (d) the tuned file and the summary (also rewritten after every step)
if [ "$PLAN" = 0 ]; then
  summarize
  echo
  cat "$OUT/summary.md" 2>/dev/null
  echo
  echo "done in $(($(date +%s) - START))s; files in $OUT:"
  (cd "$OUT" && find . -type f | sort)
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null
fi
exit 0
