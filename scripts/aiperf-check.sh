#!/usr/bin/env bash
# aiperf (NVIDIA's benchmark client, over the OpenAI-compatible HTTP API) against
# `tandem bench serve` (over gRPC) on one local deployment, at the same settings: both send
# prompts of INPUT_TOKENS tokens that share no prefix, ask for exactly OUTPUT_TOKENS tokens
# (`ignore_eos`), CONCURRENCY closed-loop users, REQUESTS requests after a warmup. Prints TTFT
# and inter-token latency from each tool and their difference; exits 1 when a P50 differs by
# more than MAX_DIFF_PCT percent.
#
# A benchmark, not a test: aiperf brings pandas, pyarrow, scipy and the like, so it lives in its
# own virtual environment, .venv-aiperf (made here from PyPI when missing). It runs offline: its
# tokenizer is the served model's own directory. Starts Ray, so on a shared machine run it as
#     flock /tmp/tandem-ray.lock bash scripts/aiperf-check.sh
# Settings (environment): CONCURRENCY=1 REQUESTS=20 WARMUP=2 INPUT_TOKENS=256 OUTPUT_TOKENS=32
# ROUNDS=4 MAX_DIFF_PCT=10 PRESET=local AIPERF_RATE (below); KEEP=DIR keeps aiperf's exports
# and bench serve's JSON there.
#
# What each figure is (both tools' clocks are the client's):
#   TTFT          send to the first token (aiperf: the first SSE event with text).
#   ITL           per request, (last token - first token) / (output tokens - 1), then mean and
#                 P50 over requests: aiperf's `inter_token_latency` and bench serve's TPOT.
#   ITL, per gap  the gaps between arrivals over every request: aiperf's `inter_chunk_latency`
#                 (per SSE event) and bench serve's ITL (per token; an event of k tokens counts
#                 as k gaps). They agree while every event carries one token.
# bench serve reports P50/P90/P99, not means, so its mean column is empty. The gate is on the
# P50s of TTFT and ITL.
set -euo pipefail
cd "$(dirname "$0")/.."

CONCURRENCY=${CONCURRENCY:-1}
REQUESTS=${REQUESTS:-20}
ROUNDS=${ROUNDS:-4}
WARMUP=${WARMUP:-2}
INPUT_TOKENS=${INPUT_TOKENS:-256}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-32}
MAX_DIFF_PCT=${MAX_DIFF_PCT:-10}
PRESET=${PRESET:-local}
# aiperf's pacing. With --concurrency alone it issues requests from a loop that spins on its event
# loop while every slot is taken, a whole core, and its processes handle each finished request
# (parse, metrics, next credit) just as the next one is sent: on a small machine that CPU is taken
# from the server's ranks (Ray runs them at nice 15), and aiperf's TTFT came out twice bench
# serve's, its ITL 70% above (without the spin, TTFT still 25-35% above). A rate cap (AIPERF_RATE requests a
# second, default half a request a second a user, below one request's ~1 s at the default sizes)
# makes the loop a timer and leaves aiperf's work between requests; the slots still cap the
# requests in flight, so at CONCURRENCY=1 the server sees one request at a time as with bench
# serve, only with an idle pause between them.
AIPERF_RATE=${AIPERF_RATE:-$(awk "BEGIN { print $CONCURRENCY / 2 }")}
PY=.venv/bin/python
TANDEM=.venv/bin/tandem
AIPERF=.venv-aiperf/bin/aiperf

if [ ! -x "$AIPERF" ]; then
    echo "aiperf-check: making .venv-aiperf (pip install aiperf)" >&2
    python3 -m venv .venv-aiperf
    .venv-aiperf/bin/pip install -q aiperf
fi

WORK=$(mktemp -d)
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    if [ -n "${KEEP:-}" ]; then
        mkdir -p "$KEEP" && cp -r "$WORK"/. "$KEEP"/
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

read -r GRPC_PORT HTTP_PORT < <("$PY" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
MODEL_DIR=$("$PY" -c "from tandem.cluster.serve import demo_model_dir; print(demo_model_dir())")

echo "aiperf-check: tandem serve --preset $PRESET --port $GRPC_PORT --http-port $HTTP_PORT" >&2
"$TANDEM" serve --preset "$PRESET" --port "$GRPC_PORT" --http-port "$HTTP_PORT" >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
if ! "$TANDEM" client health --addr "127.0.0.1:$GRPC_PORT" --wait 600 >/dev/null; then
    echo "aiperf-check: the deployment did not come up; its log:" >&2
    tail -n 40 "$WORK/serve.log" >&2
    exit 1
fi
MODEL=$("$PY" -c "
import json, urllib.request
print(json.load(urllib.request.urlopen('http://127.0.0.1:$HTTP_PORT/v1/models'))['data'][0]['id'])")
echo "aiperf-check: serving $MODEL from $MODEL_DIR" >&2

# The machine is shared and its speed drifts by tens of percent within minutes, so the tools take
# turns: ROUNDS rounds of REQUESTS/ROUNDS requests each, who goes first alternating, and each
# figure is the median over the rounds of that round's P50 (the aiperf means pool every request).
#
# aiperf: synthetic prompts of exactly INPUT_TOKENS tokens (stddev 0) of its own text corpus,
# counted by the model's tokenizer, a fresh seed and one dataset entry a request each round, so
# no prompt is sent twice and the prefix cache finds nothing; WARMUP requests of its own first
# (its connection, its workers), discarded. Token counts are the server's usage (prompt_tokens
# counts the BOS the server adds to a text prompt). The tokenizer is an absolute path, which
# aiperf loads from disk without asking the Hugging Face hub (its HF_HUB_OFFLINE mode looks paths
# up in the hub's cache instead, so it is not set).
PER_ROUND=$(((REQUESTS + ROUNDS - 1) / ROUNDS))
run_aiperf() {  # round
    "$AIPERF" profile \
        --model "$MODEL" --url "http://127.0.0.1:$HTTP_PORT" --endpoint-type completions --streaming \
        --tokenizer "$MODEL_DIR" --use-server-token-count \
        --concurrency "$CONCURRENCY" --request-rate "$AIPERF_RATE" \
        --request-count "$PER_ROUND" --warmup-request-count "$WARMUP" \
        --isl "$INPUT_TOKENS" --isl-stddev 0 --num-dataset-entries $((PER_ROUND + WARMUP)) \
        --extra-inputs "{\"max_tokens\": $OUTPUT_TOKENS, \"ignore_eos\": true}" \
        --random-seed "$1" --workers-max "$CONCURRENCY" --record-processors 1 --ui none \
        --export-level records --artifact-dir "$WORK/aiperf-$1" >"$WORK/aiperf-$1.log" 2>&1 || {
        echo "aiperf-check: aiperf failed; its log:" >&2
        tail -n 40 "$WORK/aiperf-$1.log" >&2
        exit 1
    }
}
# bench serve: random token ids, a fresh seed each round (no prefix shared with another prompt).
BENCH=("$TANDEM" bench serve --addr "127.0.0.1:$GRPC_PORT" --concurrency "$CONCURRENCY"
    --prompt-tokens "$INPUT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --shared-prefix-tokens 0
    --prefixes 1 --json)
run_bench() {  # round
    "${BENCH[@]}" --requests-per-point "$PER_ROUND" --seed $((1000 + $1)) >"$WORK/bench-$1.json"
}

echo "aiperf-check: warmup over gRPC ($WARMUP requests), then $ROUNDS rounds of $PER_ROUND" \
    "requests from each tool" >&2
"${BENCH[@]}" --requests-per-point "$WARMUP" --seed 999 >/dev/null
for round in $(seq 1 "$ROUNDS"); do
    if [ $((round % 2)) -eq 1 ]; then
        run_aiperf "$round"
        run_bench "$round"
    else
        run_bench "$round"
        run_aiperf "$round"
    fi
    echo "aiperf-check: round $round done" >&2
done

echo "aiperf-check: CONCURRENCY=$CONCURRENCY, $ROUNDS rounds of $PER_ROUND requests a tool," \
    "INPUT_TOKENS=$INPUT_TOKENS OUTPUT_TOKENS=$OUTPUT_TOKENS, preset $PRESET"
"$PY" - "$WORK" "$ROUNDS" "$MAX_DIFF_PCT" <<'EOF'
import json
import math
import statistics
import sys
from pathlib import Path

work, rounds, max_diff = Path(sys.argv[1]), range(1, int(sys.argv[2]) + 1), float(sys.argv[3])


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def aiperf_records(round_: int) -> list[dict]:
    lines = (work / f"aiperf-{round_}" / "profile_export.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if r["metadata"].get("benchmark_phase") == "profiling"]


def values(records: list[dict], tag: str) -> list[float]:
    found = [r["metrics"][tag]["value"] for r in records if tag in r["metrics"]]
    return [v for value in found for v in (value if isinstance(value, list) else [value])]


aiperf = {r: aiperf_records(r) for r in rounds}
bench = {r: json.loads((work / f"bench-{r}.json").read_text())["points"][0] for r in rounds}
every = [record for records in aiperf.values() for record in records]
isl, osl = values(every, "input_sequence_length"), values(every, "output_sequence_length")
events = [len(r["metrics"]["inter_chunk_latency"]["value"]) + 1 for r in every]
failed_aiperf = sum(1 for r in every if r.get("error"))
print(f"aiperf:      {len(every)} requests ({failed_aiperf} failed), server's prompt tokens "
      f"{min(isl):.0f}..{max(isl):.0f}, output tokens {min(osl):.0f}..{max(osl):.0f}, cached "
      f"{sum(values(every, 'usage_prompt_cache_read_tokens')):.0f}, SSE events with text "
      f"{min(events)}..{max(events)} a request")
done = sum(p["completed"] for p in bench.values())
print(f"bench serve: {done} requests ({sum(p['failed'] for p in bench.values())} failed), prompt tokens "
      f"{sum(p['prompt_tokens'] for p in bench.values()) / done:.0f}, output tokens "
      f"{sum(p['output_tokens'] for p in bench.values()) / done:.0f} a request, cached "
      f"{sum(p['cached_tokens'] for p in bench.values())}")

# (name, aiperf's per-request tag, bench serve's spread, gated)
METRICS = [
    ("TTFT", "time_to_first_token", "ttft_ms", True),
    ("ITL", "inter_token_latency", "tpot_ms", True),
    ("ITL per gap", "inter_chunk_latency", "itl_ms", False),
]
print("\nP50 of each round (ms), aiperf / bench serve:")
for name, tag, spread, _ in METRICS:
    cells = [f"{p50(values(aiperf[r], tag)):.1f} / {bench[r][spread]['p50']:.1f}" for r in rounds]
    print(f"  {name:<12}" + "   ".join(cells))

print(f"\n{'metric (ms)':<18}{'aiperf':>9}{'bench serve':>13}{'diff %':>9}")
failed = []
for name, tag, spread, gated in METRICS:
    a_mean = statistics.mean(values(every, tag))
    a = statistics.median(p50(values(aiperf[r], tag)) for r in rounds)
    b = statistics.median(bench[r][spread]["p50"] for r in rounds)
    diff = (a - b) / b * 100
    print(f"{name + ' mean':<18}{a_mean:>9.1f}{'-':>13}{'-':>9}")
    print(f"{name + ' p50':<18}{a:>9.1f}{b:>13.1f}{diff:>+9.1f}{'  (gated)' if gated else ''}")
    if gated and not abs(diff) <= max_diff:
        failed.append(f"{name} p50")
if failed:
    verb = "differs" if len(failed) == 1 else "differ"
    print(f"\naiperf-check: {' and '.join(failed)} {verb} by more than {max_diff:g}%")
    sys.exit(1)
print(f"\naiperf-check: the P50s agree within {max_diff:g}%")
EOF
