#!/usr/bin/env bash
# Every GPU-side check in one command, for a device machine: the `gpu`-marked tests, then the GPU benchmarks.
#   bash scripts/gpu_check.sh            # logs and results under $OUT (default results/gpu)
# It uses the Python it finds (PY=python3), with rlpost's source on PYTHONPATH: a machine with a CUDA torch but
# without Ray or vLLM runs the trainer-side checks that need only torch (CUDA IPC refit buffers, bf16 / memory
# phases where Ray is there); a test whose package is missing is skipped and named in the log, never failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/device.txt"
import importlib.util, torch
assert torch.cuda.is_available(), "scripts/gpu_check.sh: no CUDA device"
print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
for name in ("ray", "vllm", "megatron.core", "transformers", "hydra"):
    print(f"{name}: {'present' if importlib.util.find_spec(name) else 'absent (its checks are skipped)'}")
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

# The files that hold `gpu`-marked tests (collecting the whole suite would import Ray and vLLM everywhere).
mapfile -t files < <(grep -rl "pytest.mark.gpu" tests benchmarks --include='test_*.py' | sort)
"$PY" -m pytest -q -rs -m gpu --continue-on-collection-errors -p no:cacheprovider "${files[@]}" 2>&1 \
  | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
[ "$status" -eq 5 ] && status=0  # nothing collected: every GPU check needs a package this machine lacks

if "$PY" -c "import ray, vllm, hydra" 2>/dev/null; then  # the benchmarks run the whole stack
  "$PY" -m benchmarks.refit --out "$OUT/bench_refit.json" cluster.device=cuda 2>&1 | tee "$OUT/bench_refit.log"
  "$PY" -m benchmarks.grpo --steps 10 --out "$OUT/bench_grpo.json" cluster.device=cuda 2>&1 \
    | tee "$OUT/bench_grpo.log"
else
  echo "benchmarks skipped: they need ray, vllm and hydra on this machine" | tee "$OUT/bench_skipped.txt"
fi
exit "$status"
