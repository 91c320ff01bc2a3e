#!/usr/bin/env bash
# Accelerator checks for a machine with an NVIDIA GPU (CI has none: there these tests skip):
#   1. the engine's reference-logit tests with the engine on the GPU (fp32; the max abs diff
#      against transformers on the CPU is printed at the end),
#   2. the accelerator tests (backend, KV cache sized from free GPU memory, bf16 logits),
#   3. the engine throughput bench on the GPU: engine vs HF transformers, bf16, in one run,
#   4. a GPU + CPU cluster (configs/gpu-cpu.toml) answering a High request from the GPU pool.
# Usage: scripts/check_gpu.sh [DEVICE] [PYTHON]
#   DEVICE defaults to cuda:0; PYTHON to the project's venv (made by `make venv model`).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${1:-cuda:0}
PY=${2:-}
if [ -z "$PY" ]; then
  make venv model
  PY=.venv/bin/python
fi
"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"check_gpu: CUDA is not available to torch {torch.__version__}")
print(f"check_gpu: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PY
mkdir -p bench/results

echo "== 1-2. reference logits and accelerator tests on $DEVICE"
QOS_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/engine/test_reference_logits.py tests/engine/test_devices.py -k "not npu"

echo "== 3. engine vs HF throughput on $DEVICE (bf16)"
"$PY" bench/engine_throughput.py --device "$DEVICE" --dtypes bfloat16 --threads 4 \
  --json bench/results/engine_throughput_cuda.json

echo "== 4. a GPU + CPU cluster serves High from the GPU pool"
"$PY" -m services.tools.cli up --config configs/gpu-cpu.toml --log-level WARNING &
CLUSTER=$!
trap 'kill $CLUSTER 2>/dev/null; wait $CLUSTER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  "$PY" -m services.tools.healthcheck 127.0.0.1:50051 >/dev/null 2>&1 && break
  sleep 1
done
"$PY" -m services.tools.cli generate --router 127.0.0.1:50051 --priority high --max-tokens 32 \
  "Name three rivers in Europe."
"$PY" -m services.tools.cli stats --router 127.0.0.1:50051
