#!/usr/bin/env bash
# guidellm (PyPI) against the OpenAI-compatible HTTP API of `tandem serve`, in its default
# streaming mode (stream_options with include_usage and continuous_usage_stats): a short
# synchronous run of synthetic prompts, then its tables (TTFT, ITL, TPOT, throughput; every
# request must complete, none may fail).
#
# guidellm lives in its own virtual environment (GUIDELLM_VENV, made here from PyPI when
# missing). It pulls torch with CUDA libraries from PyPI: about 6 GB and several minutes on a
# first run; it is not part of the test run (tests/integration/test_openai_http.py sends its
# request shape). It runs offline: the tokenizer is the served model's own directory.
#
# Starts Ray (embedded, by `tandem serve`), so on a shared machine run it as
#     flock /tmp/tandem-ray.lock bash scripts/guidellm.sh
# Settings (environment): REQUESTS=8 PROMPT_TOKENS=128 OUTPUT_TOKENS=16 PROFILE=synchronous
# PRESET=local PORT (HTTP; default a free one) WAIT_S=600 MODEL_DIR (default: the demo model)
# GUIDELLM_VENV=/tmp/guidellm-venv; URL=http://HOST:PORT runs against a server already up there
# and starts none. Further arguments go to `guidellm run`.
set -euo pipefail
cd "$(dirname "$0")/.."

REQUESTS=${REQUESTS:-8}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-16}
PROFILE=${PROFILE:-synchronous}
PRESET=${PRESET:-local}
GUIDELLM_VENV=${GUIDELLM_VENV:-/tmp/guidellm-venv}
PY=.venv/bin/python
TANDEM=.venv/bin/tandem

if ! "$GUIDELLM_VENV/bin/guidellm" --version >/dev/null 2>&1; then
    echo "guidellm: installing guidellm into $GUIDELLM_VENV (about 6 GB)" >&2
    python3 -m venv "$GUIDELLM_VENV"
    "$GUIDELLM_VENV/bin/pip" install -q guidellm
fi

MODEL_DIR=${MODEL_DIR:-$("$PY" -c "from tandem.cluster.serve import demo_model_dir; print(demo_model_dir())")}
MODEL_DIR=$(cd "$MODEL_DIR" && pwd)  # absolute: transformers reads it from disk, not the hub

OUT=$(mktemp -d)
# shellcheck source=scripts/http-server.sh
source scripts/http-server.sh
trap 'stop_http_server; rm -rf "$OUT"' EXIT
start_http_server guidellm
echo "guidellm: $URL serves $MODEL; $REQUESTS requests, profile $PROFILE" >&2

(cd "$OUT" && HF_HUB_OFFLINE=1 "$GUIDELLM_VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$URL,model=$MODEL" \
    --profile "kind=$PROFILE" --constraint "kind=max_requests,count=$REQUESTS" \
    --tokenizer "kind=huggingface_auto,model=$MODEL_DIR" \
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
    --output kind=console --output "kind=json,path=$OUT/benchmarks.json" --disable-console-interactive "$@")

# every request completed, none failed or was cut short
"$PY" - "$OUT/benchmarks.json" "$REQUESTS" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
for bench in report["benchmarks"]:
    totals = bench["metrics"]["request_totals"]
    print(f"guidellm: {totals}", file=sys.stderr)
    if totals["errored"] or totals["incomplete"] or totals["successful"] < int(sys.argv[2]):
        sys.exit(f"guidellm: not every request completed: {totals}")
PYEOF
