#!/usr/bin/env bash
# On a machine with a CUDA GPU: compile every Triton kernel, check it against its torch
# reference and time it at DeepSeek-V3 shapes; the table comes last. Ends well inside 10 minutes.
# Needs a CUDA build of torch (see README) and Tandem installed; run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible to torch")'
exec timeout 540 "$PY" -m bench.gpu_check --shapes deepseek-v3 --dtype bfloat16 "$@"
