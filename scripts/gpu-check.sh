#!/usr/bin/env bash
# On a machine with a CUDA GPU: the tiny model end to end with its kernels compiled (greedy tokens
# against torch on the CPU), a layer-wise KV transfer between two VRAM pools (page for page), the
# decode step at batch 1 and 64 eager against CUDA graphs (every bucket captured at start; same
# tokens, step times; both again under CUDA's sync debug mode, mixed steps included), then
# every Triton kernel compiled, checked against its torch reference and timed at DeepSeek-V3
# shapes as a fraction of this GPU's roofline (model/kernels/roofline.py), with the targets met or
# missed; the table comes last. Ends well inside 10 minutes.
# Needs a CUDA build of torch (see README); runs from the repository root (the tandem/ links give
# the package) whether or not Tandem is installed.
# Every check runs, even after one failed, so the table still prints; the script then exits 1
# naming each check that failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible to torch")'
failed=()
check() {  # check NAME SECONDS MODULE [ARGS...]
  local name=$1 seconds=$2 status=0
  shift 2
  timeout "$seconds" "$PY" -m "$@" || status=$?
  if [ "$status" -ne 0 ]; then
    echo "gpu-check: the $name check failed (exit $status)" >&2
    failed+=("$name")
  fi
}
check model 120 tandem.bench.gpu_model_check
check transfer 120 tandem.bench.gpu_transfer_check
check decode-step 150 tandem.bench.gpu_decode_check
check kernels 420 tandem.bench.gpu_check --shapes deepseek-v3 --dtype bfloat16 "$@"
if [ "${#failed[@]}" -ne 0 ]; then
  echo "gpu-check: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "gpu-check: every check passed"
