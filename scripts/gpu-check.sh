#!/usr/bin/env bash
# On a machine with a CUDA GPU: the tiny model end to end with its kernels compiled (greedy tokens
# against torch on the CPU), a layer-wise KV transfer between two VRAM pools (page for page), the
# decode step at batch 1 and 64 eager against CUDA graphs (same tokens, step times), then
# every Triton kernel compiled, checked against its torch reference and timed at DeepSeek-V3
# shapes; the table comes last. Ends well inside 10 minutes.
# Needs a CUDA build of torch (see README); runs from the repository root (the tandem/ links give
# the package) whether or not Tandem is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible to torch")'
timeout 120 "$PY" -m tandem.bench.gpu_model_check || echo "gpu-check: the model check failed (exit $?)" >&2
timeout 120 "$PY" -m tandem.bench.gpu_transfer_check || echo "gpu-check: the transfer check failed (exit $?)" >&2
timeout 150 "$PY" -m tandem.bench.gpu_decode_check || echo "gpu-check: the decode-step check failed (exit $?)" >&2
exec timeout 420 "$PY" -m tandem.bench.gpu_check --shapes deepseek-v3 --dtype bfloat16 "$@"
