"""The parsers of ``tandem serve``, ``tandem metrics`` and ``tandem client``, and the speculation
and KV-tier options that ``generate`` and ``plan memory`` share with ``serve``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.frontend.limits import EdgeLimits
from tandem.model.dtype_names import AUTO
from tandem.model.dtype_names import NAMES as DTYPE_NAMES


def add_serving_parsers(sub: Any, sampling_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """``tandem serve``, ``tandem metrics`` and ``tandem client``."""
    srv = sub.add_parser("serve", help="start the cluster and the gRPC frontend; Ctrl-C stops")
    _serve_model_arguments(srv)
    _serve_edge_arguments(srv)
    _serve_limit_arguments(srv)
    _serve_deployment_arguments(srv)
    _add_metrics_parsers(sub)
    _add_client_parsers(sub, sampling_args)


def _serve_model_arguments(srv: argparse.ArgumentParser) -> None:
    """The model, its topology, speculation and KV tiers."""
    srv.add_argument("--preset", default=None, help="topology preset of deploy/presets (default: local)")
    srv.add_argument("--topology", type=Path, default=None, help="topology file (instead of --preset)")
    srv.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model directory (default: the demo model the project trains)",
    )
    srv.add_argument("--model-name", default=None, help="name clients give (default: the directory's)")
    add_rank_arguments(srv)


def _serve_edge_arguments(srv: argparse.ArgumentParser) -> None:
    """Where the edges listen and who may call them; the process options."""
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    srv.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/...) here; 0: a free port",
    )
    srv.add_argument("--http-host", default=None, help="address the HTTP API binds (default: --host)")
    srv.add_argument(
        "--dtype",
        choices=[AUTO, *DTYPE_NAMES],
        default=AUTO,
        help="the model's activation dtype (auto: bfloat16 on GPU ranks, float32 on CPU ranks)",
    )
    srv.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    srv.add_argument("--max-running-requests", type=int, default=256, help="beyond: RESOURCE_EXHAUSTED")
    srv.add_argument(
        "--migration-wait",
        type=float,
        default=60.0,
        help="seconds a stream whose decode rank failed waits for a decode rank to resume on (its own "
        "group rebuilt, where no other takes work) before it ends with the error; 0: it ends at once",
    )
    srv.add_argument(
        "--auth-token-file",
        type=Path,
        default=None,
        help="require a bearer token: the file holds one, or name:token lines, one client each",
    )
    srv.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS")
    srv.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")


def _serve_limit_arguments(srv: argparse.ArgumentParser) -> None:
    """The edge's limits (``EdgeLimits``' defaults)."""
    limits = EdgeLimits()
    srv.add_argument(
        "--max-requests-per-client",
        type=int,
        default=None,
        help="streams one client runs at once (default: no cap)",
    )
    srv.add_argument(
        "--max-request-bytes", type=int, default=limits.max_request_bytes, help="a larger request is refused"
    )
    srv.add_argument(
        "--keepalive-time",
        type=float,
        default=limits.keepalive_time_s,
        help="seconds between the server's pings",
    )
    srv.add_argument(
        "--keepalive-timeout",
        type=float,
        default=limits.keepalive_timeout_s,
        help="seconds to wait for a ping's answer before closing the connection",
    )
    srv.add_argument(
        "--max-connection-idle",
        type=float,
        default=limits.max_connection_idle_s,
        help="seconds without a call before a connection is closed (0: never)",
    )
    srv.add_argument(
        "--max-connection-age",
        type=float,
        default=0.0,
        help="seconds before a connection is recycled (0: never)",
    )
    srv.add_argument(
        "--max-connection-age-grace",
        type=float,
        default=limits.max_connection_age_grace_s,
        help="seconds a recycled connection's calls get to finish",
    )
    srv.add_argument(
        "--min-ping-interval",
        type=float,
        default=limits.min_ping_interval_s,
        help="seconds between a client's pings while it runs no call; faster ones close its connection",
    )
    srv.add_argument(
        "--stream-interval",
        type=int,
        default=limits.stream_interval,
        help="tokens a stream's message waits for (the first and the last go at once); "
        "more: fewer, larger messages and more streams per frontend core",
    )
    srv.add_argument(
        "--grammar-compile-limit",
        type=float,
        default=limits.grammar_compile_limit_s,
        help="seconds a structured output's grammar may take to compile at the frontend; "
        "longer: the request is refused (400 naming response_format or tools)",
    )


def _serve_deployment_arguments(srv: argparse.ArgumentParser) -> None:
    """Metrics, autoscaling and the deployment on its cluster."""
    srv.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics and the deployment's discovery document /sd here (0: a free port)",
    )
    srv.add_argument(
        "--metrics-token-file",
        default=None,
        help="a file holding the bearer token every metrics endpoint asks for (frontend, controller, ranks)",
    )
    srv.add_argument(
        "--metrics-tls-cert", default=None, help="PEM certificate: every metrics endpoint speaks HTTPS"
    )
    srv.add_argument("--metrics-tls-key", default=None, help="PEM private key of --metrics-tls-cert")

    srv.add_argument(
        "--autoscale", action="store_true", help="resize the pools by the topology's autoscaling:"
    )
    srv.add_argument("--prometheus-url", default=None, help="the autoscaler's Prometheus (default: run one)")
    srv.add_argument("--autoscale-dry-run", action="store_true", help="decide and record, do not act")
    srv.add_argument("--name", default="tandem", help="the deployment's name, one per Ray cluster")
    srv.add_argument(
        "--detach", action="store_true", help="leave it running on the cluster (needs --address)"
    )
    srv.add_argument("--frontends", type=int, default=1, help="frontend actors, on ports --port + i")
    srv.add_argument("--dry-run", action="store_true", help="print where every group would go, start nothing")


def _add_metrics_parsers(sub: Any) -> None:
    """``tandem metrics prometheus-config``."""
    metrics = sub.add_parser("metrics", help="Prometheus set-up").add_subparsers(
        dest="metrics_command", required=True
    )
    pcfg = metrics.add_parser("prometheus-config", help="print the scrape configuration of a deployment")
    pcfg.add_argument("--addr", required=True, help="HOST:PORT of `tandem serve --metrics-port`")
    pcfg.add_argument("--scrape-interval", type=float, default=5.0, help="seconds")
    pcfg.add_argument("--token-file", default=None, help="the deployment's --metrics-token-file")
    pcfg.add_argument("--ca-file", default=None, help="PEM to trust: scrape over HTTPS")


def _add_client_parsers(sub: Any, sampling_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """``tandem client generate | status | health``."""
    client = sub.add_parser("client", help="talk to a running `tandem serve`").add_subparsers(
        dest="client_command", required=True
    )
    cgen = client.add_parser("generate", help="generate over gRPC")
    csrc = cgen.add_mutually_exclusive_group(required=True)
    csrc.add_argument("text", nargs="?", default=None, help="prompt text")
    csrc.add_argument("--prompts-file", type=Path, help="JSONL, one prompt object a line")
    sampling_args(cgen)
    cgen.add_argument("--stream", action="store_true", help="print text as it arrives")
    cgen.add_argument("--concurrency", type=int, default=1, help="streams open at once")
    cgen.add_argument("--json", action="store_true", help="print one JSON object")
    cstat = client.add_parser("status", help="groups, ranks, loads and free pages")
    cstat.add_argument("--check-integrity", action="store_true")
    chealth = client.add_parser("health", help="exit 0 once the server is SERVING")
    chealth.add_argument("--wait", type=float, default=0.0, help="seconds to keep asking")
    for c in (cgen, cstat, chealth):
        c.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT of the frontend")
        c.add_argument("--token-file", type=Path, default=None, help="bearer token to send")
        c.add_argument("--tls-ca", default=None, help="PEM of the CA to trust: use TLS")
        c.add_argument("--timeout", type=float, default=None, help="deadline of each call, seconds")


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        help="draft tokens a decode step verifies per request (0..16; 0 = off; default: the topology's)",
    )
    parser.add_argument(
        "--drafter",
        default=None,
        help="ngram (prompt lookup) or mtp (the checkpoint's MTP layer); default: the topology's",
    )


def add_rank_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``generate`` and ``serve`` set of the ranks: speculation, KV tiers, prefill chunks."""
    add_speculative_arguments(parser)
    add_tier_arguments(parser)
    parser.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the most prompt tokens one request computes in a step (default: as many as the step's budget)",
    )


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host-cache-pages",
        type=int,
        default=None,
        help="host-memory KV pages per prefill rank: the tier evicted device pages go to (default: topology)",
    )
    parser.add_argument(
        "--device-cache-pages",
        type=int,
        default=None,
        help="cap each prefill rank's device KV pool at this many pages (tests and demos of the tiers)",
    )
    parser.add_argument(
        "--kv-store",
        default=None,
        metavar="auto|HOST:PORT",
        help="share KV across ranks in a Mooncake store: auto starts mooncake_master with the deployment, "
        "HOST:PORT uses a running master (default: the topology's store:)",
    )
    parser.add_argument(
        "--kv-store-secret-file",
        default=None,
        metavar="PATH",
        help="a file holding the secret that signs the store's blocks; deployments that share a store "
        "name the same one (default: the topology's store.secret_file, $TANDEM_KV_STORE_SECRET, or a "
        "random one)",
    )
