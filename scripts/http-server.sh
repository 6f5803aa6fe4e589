# Sourced by the scripts that run a third-party client against `tandem serve`'s HTTP API
# (lm-eval.sh, guidellm.sh): start_http_server NAME starts `tandem serve --preset $PRESET
# --model $MODEL_DIR` on free ports (HTTP on $PORT when set), unless URL names a server already
# up, waits for its /health (WAIT_S, default 600) and sets URL and MODEL (the served name). The
# server is stopped and its log removed when the script exits; a server that does not come up
# ends the script with its log's tail. Needs PY, TANDEM, PRESET and MODEL_DIR.

HTTP_SERVER_LOG=$(mktemp)
SERVER_PID=""
stop_http_server() {
    if [ -n "$SERVER_PID" ]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    rm -f "$HTTP_SERVER_LOG"
}
trap stop_http_server EXIT

start_http_server() {
    local name=$1
    if [ -z "${URL:-}" ]; then
        local grpc_port free_port
        read -r grpc_port free_port < <("$PY" -c "
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(('127.0.0.1', 0))
print(*(s.getsockname()[1] for s in socks))")
        PORT=${PORT:-$free_port}
        URL=http://127.0.0.1:$PORT
        echo "$name: tandem serve --preset $PRESET --model $MODEL_DIR --port $grpc_port --http-port $PORT" >&2
        "$TANDEM" serve --preset "$PRESET" --model "$MODEL_DIR" --port "$grpc_port" --http-port "$PORT" \
            >"$HTTP_SERVER_LOG" 2>&1 &
        SERVER_PID=$!
    fi
    # GET /health answers 200 once the deployment serves (503 before, no answer before it listens)
    echo "$name: waiting for $URL/health" >&2
    local deadline=$((SECONDS + ${WAIT_S:-600}))
    until "$PY" -c "import urllib.request; urllib.request.urlopen('$URL/health', timeout=2)" 2>/dev/null; do
        if [ -n "$SERVER_PID" ] && ! kill -0 "$SERVER_PID" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
            echo "$name: $URL did not come up; the server's log:" >&2
            tail -n 40 "$HTTP_SERVER_LOG" >&2
            exit 1
        fi
        sleep 1
    done
    MODEL=$("$PY" -c "
import json, urllib.request
print(json.load(urllib.request.urlopen('$URL/v1/models', timeout=10))['data'][0]['id'])")
}
