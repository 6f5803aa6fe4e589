#!/usr/bin/env bash
# lm-evaluation-harness (PyPI's lm_eval, its `local-completions` model) against the
# OpenAI-compatible HTTP API of `tandem serve`: loglikelihood tasks, by default tandem_mc of
# scripts/lm_eval/ (eight cloze items of the demo model's own corpus, local data, no hub).
# Prints lm_eval's results table.
#
# lm_eval lives in its own virtual environment (LMEVAL_VENV, made here from PyPI when missing:
# lm_eval[api] and transformers, for the tokenizer; no torch). It runs offline: the tokenizer
# is the served model's own directory, read from disk. For each choice lm_eval sends the
# context and continuation as token ids (tokenized_requests, with the BOS the server would add
# to text), asks for `echo` with `logprobs`, `max_tokens` 1, and sums the continuation's
# `token_logprobs`, which it finds by counting the context's tokens.
#
# Starts Ray (embedded, by `tandem serve`), so on a shared machine run it as
#     flock /tmp/tandem-ray.lock bash scripts/lm-eval.sh
# Settings (environment): TASKS=tandem_mc LIMIT=5 PRESET=local PORT (HTTP; default a free one)
# WAIT_S=600 MODEL_DIR (default: the demo model) LMEVAL_VENV=/tmp/lmeval-venv; URL=http://HOST:PORT runs
# against a server already up there and starts none. Further arguments go to `lm_eval run`
# (e.g. --log_samples --output_path DIR).
set -euo pipefail
cd "$(dirname "$0")/.."

TASKS=${TASKS:-tandem_mc}
LIMIT=${LIMIT:-5}
PRESET=${PRESET:-local}
LMEVAL_VENV=${LMEVAL_VENV:-/tmp/lmeval-venv}
PY=.venv/bin/python
TANDEM=.venv/bin/tandem

if ! "$LMEVAL_VENV/bin/python" -c "import lm_eval, transformers" 2>/dev/null; then
    echo "lm-eval: installing lm_eval into $LMEVAL_VENV" >&2
    python3 -m venv "$LMEVAL_VENV"
    "$LMEVAL_VENV/bin/pip" install -q 'lm_eval[api]' transformers
fi

MODEL_DIR=${MODEL_DIR:-$("$PY" -c "from tandem.cluster.serve import demo_model_dir; print(demo_model_dir())")}
MODEL_DIR=$(cd "$MODEL_DIR" && pwd)  # absolute: transformers reads it from disk, not the hub

# shellcheck source=scripts/http-server.sh
source scripts/http-server.sh
start_http_server lm-eval
echo "lm-eval: $URL serves $MODEL; tasks $TASKS, limit $LIMIT" >&2

# batch_size 1: the server takes one prompt a request. max_retries=1: a failure is not retried.
ARGS="model=$MODEL,base_url=$URL/v1/completions,tokenizer_backend=huggingface,tokenizer=$MODEL_DIR"
ARGS+=",tokenized_requests=True,add_bos_token=True,num_concurrent=1,max_retries=1"
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$LMEVAL_VENV/bin/lm_eval" run --model local-completions \
    --model_args "$ARGS" --tasks "$TASKS" --include_path scripts/lm_eval \
    --limit "$LIMIT" --batch_size 1 "$@"
