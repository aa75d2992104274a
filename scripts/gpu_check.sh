#!/usr/bin/env bash
# The GPU-side checks for a device machine, in parts of at most 8 minutes each (one device call per part):
#   bash scripts/gpu_check.sh list     # the parts and what each runs
#   bash scripts/gpu_check.sh part1    # one part (part1 ... part6); `all` runs them in turn
# Python: the project's venv (.venv/bin/python), else $PY (default python3); the first line says which. rlpost's
# source is on PYTHONPATH and the Python's bin/ first on PATH (the `rlpost` CLI the GRPO tests start). A test whose
# package is missing skips and is named in the log, never failed. Logs and results go under $OUT (default
# results/gpu); each part ends with a `== gpu_check partN ==` block of its numbers, to paste as it is. A part that
# runs past PART_TIMEOUT_S (470 s) is interrupted: pytest still prints what ran.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
PART_TIMEOUT_S=${PART_TIMEOUT_S:-470}
GPU_EXPR="gpu and not gpu2"

describe() {  # one line per part: what it runs
  case $1 in
    part1) echo "device line (scripts/check_cuda.py, packages), then the unit-level gpu tests (-m '$GPU_EXPR' in the gpu-marked files outside tests/integration: CUDA IPC buffers, NVML, collective tensors)" ;;
    part2) echo "-m '$GPU_EXPR' in tests/integration/test_gpu.py, all but the GRPO runs: bf16 steps (DTensor, Megatron, +-LoRA), memory phases, the memory plan against max_memory_allocated" ;;
    part3) echo "-m '$GPU_EXPR' -k grpo_on_gpu in tests/integration/test_gpu.py: the default job on CUDA vLLM (full, LoRA adapter)" ;;
    part4) echo "-m '$GPU_EXPR' in the gpu-marked files of tests/integration but test_gpu.py: engine and GRPO checks (sleep/wake, start-up memory, PPO, async IPC)" ;;
    part5) echo "-m gpu2 in every gpu2-marked file (skipped with one GPU): NCCL refit, FSDP2 / Megatron TP=2 and DP=2, vLLM TP=2" ;;
    part6) echo "python -m benchmarks.refit --refits 4 cluster.device=cuda (GPU policy, CUDA IPC, sleeping engine), then python -m benchmarks.grpo --steps 6 --no-limits cluster.device=cuda" ;;
    *) return 1 ;;
  esac
}
PARTS=(part1 part2 part3 part4 part5 part6)

marked_files() {  # the test files holding a marker matching $1 (an ERE), sorted
  grep -rlE "pytest\.mark\.($1)\b" tests benchmarks --include='test_*.py' | sort
}

files_of() {  # the files a pytest part runs
  case $1 in
    part1) marked_files gpu | grep -v '^tests/integration/' ;;
    part2 | part3) marked_files gpu | grep -E '^tests/integration/test_gpu\.py$' ;;
    part4) marked_files gpu | grep '^tests/integration/' | grep -vx 'tests/integration/test_gpu\.py' ;;
    part5) marked_files gpu2 ;;
  esac
}

if [ "${1:-}" = list ] || [ -z "${1:-}" ]; then
  for p in "${PARTS[@]}"; do
    echo "$p: $(describe "$p")"
    files=$(files_of "$p" | tr '\n' ' ')
    [ -z "$files" ] || echo "       files: $files"
  done
  [ -n "${1:-}" ] || { echo "usage: bash scripts/gpu_check.sh list|all|part1..part6" >&2; exit 2; }
  exit 0
fi

if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PY:-python3}; fi
PYBIN=$(dirname "$(command -v "$PY")")
export PATH="$PYBIN:$PATH" PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"

summary() {  # summary PART STATUS SECONDS LINES...: the block to paste
  local part=$1 status=$2 secs=$3
  shift 3
  echo "== gpu_check $part: exit $status, ${secs}s, python $PY =="
  printf '%s\n' "$@"
  echo "== end $part =="
}

run_pytest() {  # run_pytest PART MARKER_EXPR [pytest args...]: the part's files under its marker expression
  local part=$1 expr=$2 start=$SECONDS log="$OUT/$1.log"
  shift 2
  mapfile -t files < <(files_of "$part")
  if [ "${#files[@]}" -eq 0 ]; then
    summary "$part" 0 0 "no files hold these tests yet"
    return 0
  fi
  timeout --signal=INT --kill-after=20 "$PART_TIMEOUT_S" "$PY" -m pytest -q -rfEs -m "$expr" --durations=10 \
    --continue-on-collection-errors -p no:cacheprovider "$@" "${files[@]}" 2>&1 | tee "$log"
  local status=${PIPESTATUS[0]}
  [ "$status" -eq 5 ] && status=0  # nothing selected: every test here needs a package or GPUs this machine lacks
  [ "$status" -eq 124 ] && echo "gpu_check: $part stopped after ${PART_TIMEOUT_S}s (PART_TIMEOUT_S)" | tee -a "$log"
  mapfile -t lines < <(grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|^[0-9.]+s (call|setup|teardown) |(passed|failed|skipped|deselected|errors?|no tests ran).* in [0-9.]+s' "$log" | tail -n 30)
  summary "$part" "$status" $((SECONDS - start)) "${lines[@]}"
  return "$status"
}

part1() {
  local start=$SECONDS status
  "$PY" scripts/check_cuda.py 2>&1 | tee "$OUT/device.txt"
  status=${PIPESTATUS[0]}
  "$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/device.txt"
import importlib.util, platform, torch
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
name = torch.cuda.get_device_name(0) if gpus else "none"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), {gpus} x {name}")
for pkg in ("ray", "vllm", "megatron.core", "transformers", "hydra"):
    print(f"{pkg}: {'present' if importlib.util.find_spec(pkg) else 'absent (its checks are skipped)'}")
PYEOF
  mapfile -t device < "$OUT/device.txt"
  summary device "$status" $((SECONDS - start)) "${device[@]}"
  [ "$status" -eq 0 ] || return "$status"
  run_pytest part1 "$GPU_EXPR"
}

part6() {
  local start=$SECONDS status=0 refit=0 grpo=0
  if ! "$PY" -c "import ray, vllm, hydra" 2>/dev/null; then
    summary part6 0 0 "benchmarks skipped: they need ray, vllm and hydra on this machine"
    return 0
  fi
  rm -f "$OUT/bench_refit.json" "$OUT/bench_grpo.json"
  timeout --signal=INT 240 "$PY" -m benchmarks.refit --refits 4 --out "$OUT/bench_refit.json" cluster.device=cuda \
    2>&1 | tee "$OUT/bench_refit.log"
  refit=${PIPESTATUS[0]}
  timeout --signal=INT $((PART_TIMEOUT_S - (SECONDS - start))) "$PY" -m benchmarks.grpo --steps 6 --warmup 2 \
    --no-limits --out "$OUT/bench_grpo.json" cluster.device=cuda 2>&1 | tee "$OUT/bench_grpo.log"
  grpo=${PIPESTATUS[0]}
  [ "$refit" -eq 0 ] && [ "$grpo" -eq 0 ] || status=1
  mapfile -t lines < <("$PY" - "$OUT/bench_refit.json" "$OUT/bench_grpo.json" <<'PYEOF'
import json, sys
KEYS = {"bench_refit": ("moved_bytes", "refit_s", "refit_gbps_median", "limits"),
        "bench_grpo": ("steps", "setup_s", "time_to_first_step_s", "phase_mean_s", "tokens_per_sec",
                       "generation_tokens_per_sec", "peak_memory_gib", "final_reward")}
for path in sys.argv[1:]:
    name = path.rsplit("/", 1)[-1].removesuffix(".json")
    try:
        runs = json.load(open(path))
    except (OSError, ValueError):
        print(f"{name}: no result")
        continue
    newest = list(runs.values())[-1]
    print(f"{name}: {json.dumps({k: newest[k] for k in KEYS[name] if k in newest})}")
PYEOF
)
  summary part6 "$status" $((SECONDS - start)) "benchmarks.refit exit $refit, benchmarks.grpo exit $grpo" \
    "$(grep -h '^refit moving' "$OUT/bench_refit.log" | tail -n 1)" "${lines[@]}"
  return "$status"
}

run_part() {
  case $1 in
    part1) part1 ;;
    part2) run_pytest part2 "$GPU_EXPR" -k "not grpo_on_gpu" ;;
    part3) run_pytest part3 "$GPU_EXPR" -k grpo_on_gpu ;;
    part4) run_pytest part4 "$GPU_EXPR" ;;
    part5) run_pytest part5 gpu2 ;;
    part6) part6 ;;
    *) echo "gpu_check: unknown part '$1' (bash scripts/gpu_check.sh list)" >&2; return 2 ;;
  esac
}

echo "gpu_check: python $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)), results under $OUT"
if [ "$1" = all ]; then
  rc=0
  for p in "${PARTS[@]}"; do run_part "$p" || rc=1; done
  exit "$rc"
fi
run_part "$1"
