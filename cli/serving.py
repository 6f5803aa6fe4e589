"""The ``tandem serve`` and ``tandem client`` commands: their options and what they run."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.client.output import emit
from tandem.client.prompts import PromptSpec
from tandem.frontend.limits import EdgeLimits
from tandem.wire.request_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from tandem.cluster.serve import ServeOptions
    from tandem.cluster.topology import Topology


def with_tiers(args: argparse.Namespace, topology: Topology) -> Topology:
    """The topology with ``--host-cache-pages``, ``--device-cache-pages`` and ``--kv-store``."""
    from tandem.cluster.topology import StoreSpec

    host, device, store = args.host_cache_pages, args.device_cache_pages, args.kv_store
    secret_file = args.kv_store_secret_file
    if host is None and device is None and store is None and secret_file is None:
        return topology
    for flag, value in (("--host-cache-pages", host), ("--device-cache-pages", device)):
        if value is not None and (value < 0 or (flag == "--device-cache-pages" and value < 1)):
            raise InvalidRequestError(
                flag, f"must be {'positive' if flag == '--device-cache-pages' else '>= 0'}, got {value}"
            )
    pool = "colocated" if topology.colocated is not None else "prefill"  # the pool that prefills
    resized = getattr(topology, pool).model_copy(
        update={k: v for k, v in (("host_cache_pages", host), ("num_pages", device)) if v is not None}
    )
    update: dict[str, object] = {pool: resized}
    if store is not None:
        try:
            update["store"] = StoreSpec() if store == "auto" else StoreSpec(master=store)
        except ValueError:
            raise InvalidRequestError("--kv-store", f"auto or HOST:PORT, got {store!r}") from None
    if secret_file is not None:
        spec = update.get("store", topology.store)
        if not isinstance(spec, StoreSpec):
            raise InvalidRequestError(
                "--kv-store-secret-file", "signs the store's blocks: give --kv-store too"
            )
        update["store"] = spec.model_copy(update={"secret_file": secret_file})
    return topology.model_copy(update=update)


def prefill_chunk_tokens(args: argparse.Namespace) -> int | None:
    """``--prefill-chunk-tokens``, checked."""
    value: int | None = args.prefill_chunk_tokens
    if value is not None and value < 1:
        raise InvalidRequestError("--prefill-chunk-tokens", f"must be at least 1, got {value}")
    return value


def with_prefill_chunk(args: argparse.Namespace, topology: Topology) -> Topology:
    """The topology with ``--prefill-chunk-tokens`` on the pool that prefills."""
    value = prefill_chunk_tokens(args)
    if value is None:
        return topology
    pool = "colocated" if topology.colocated is not None else "prefill"
    return topology.model_copy(
        update={pool: getattr(topology, pool).model_copy(update={"prefill_chunk_tokens": value})}
    )


def with_speculative(args: argparse.Namespace, topology: Topology) -> Topology:
    """The topology with ``--speculative-tokens`` / ``--drafter`` applied, each checked here."""
    from tandem.cluster.topology import SpeculativeSpec
    from tandem.engine.speculation import DRAFTERS, MAX_SPECULATIVE_TOKENS

    k, drafter = args.speculative_tokens, args.drafter
    if k is not None and not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidRequestError("--speculative-tokens", f"must be in 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
    if drafter is not None and drafter not in DRAFTERS:
        raise InvalidRequestError("--drafter", f"must be one of {', '.join(DRAFTERS)}, got {drafter!r}")
    if k is None and drafter is None:
        return topology
    spec = topology.speculative.model_dump()
    spec.update({name: v for name, v in (("tokens", k), ("drafter", drafter)) if v is not None})
    try:
        return topology.model_copy(update={"speculative": SpeculativeSpec(**spec)})
    except ValueError as exc:
        raise InvalidRequestError("--speculative-tokens", str(exc)) from None


def fit_v4_deployment(topology: Topology, model_dir: Path | None) -> Topology:
    """The topology for the directory's model: unchanged for DeepSeek-V3; for DeepSeek-V4 its
    pools' pages a multiple of every compression rate (``model/v4/kv_layout.v4_page_size``: a
    page boundary is every layer's compression boundary), and what its ranks do not do yet
    refused by the flag that asks for it (torch-free: only ``config.json`` is read)."""
    from tandem.model.family import read_config
    from tandem.model.v4.config import V4Config
    from tandem.model.v4.kv_layout import v4_page_size

    if model_dir is None or not (model_dir / "config.json").is_file():
        return topology  # nothing to tell apart here: the checks that follow name what is missing
    cfg = read_config(model_dir)
    if not isinstance(cfg, V4Config):
        return topology
    update = {
        name: pool.model_copy(update={"page_size": v4_page_size(cfg, pool.page_size)})
        for name in ("prefill", "decode", "colocated")
        if (pool := getattr(topology, name)) is not None
    }
    return topology.model_copy(update=update)


def check_deployment_model(model_dir: Path | None) -> None:
    """A deployment's model directory checked whole before anything starts (its tokenizer and
    every tensor's name, shape and dtype), of either family."""
    if model_dir is None:
        return
    from tandem.model.family import read_config
    from tandem.model.v4.config import V4Config

    if isinstance(read_config(model_dir), V4Config):
        from tandem.model.v4.checkpoint import check_v4_model_dir

        check_v4_model_dir(model_dir)
    else:
        from tandem.model.checkpoint import check_model_dir

        check_model_dir(model_dir)


def check_drafter_model(topology: Topology, model_dir: Path | None) -> None:
    """With MTP drafts, the checkpoint's MTP layer is checked here (names and shapes), before
    anything starts: a checkpoint without one, or with a wrong tensor, is refused naming it."""
    from tandem.model.checkpoint import check_model_dir
    from tandem.model.errors import ModelFileError
    from tandem.model.family import read_config
    from tandem.model.v4.checkpoint import check_v4_model_dir
    from tandem.model.v4.config import V4Config

    spec = topology.speculative
    if not spec.tokens or spec.drafter != "mtp":
        return
    if model_dir is None:
        from tandem.cluster.serve import demo_model_dir

        model_dir = demo_model_dir()
    try:
        if isinstance(read_config(model_dir), V4Config):
            check_v4_model_dir(model_dir, mtp=True)
        else:
            check_model_dir(model_dir, mtp=True)
    except ModelFileError as exc:
        raise InvalidRequestError("--drafter mtp", str(exc)) from None


def _read_secret(path: Path | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise InvalidRequestError(flag, f"cannot read {path}: {exc.strerror}") from None
    if not secret:
        raise InvalidRequestError(flag, f"{path} is empty")
    return secret


def edge_limits(args: argparse.Namespace) -> EdgeLimits:
    """The limits of ``serve``'s options, checked; an error names the flag."""
    limits = EdgeLimits(
        max_requests_per_client=args.max_requests_per_client,
        max_request_bytes=args.max_request_bytes,
        keepalive_time_s=args.keepalive_time,
        keepalive_timeout_s=args.keepalive_timeout,
        max_connection_idle_s=args.max_connection_idle or None,
        max_connection_age_s=args.max_connection_age or None,
        max_connection_age_grace_s=args.max_connection_age_grace,
        min_ping_interval_s=args.min_ping_interval,
        stream_interval=args.stream_interval,
        grammar_compile_limit_s=args.grammar_compile_limit,
    )
    try:
        limits.check()
    except ValueError as exc:
        setting, why = str(exc).split(": ", 1)
        flag = "--" + setting.removesuffix("_s").replace("_", "-")
        raise InvalidRequestError(flag, why) from None
    return limits


def read_auth_tokens(path: Path | None) -> str | None:
    """The text of ``--auth-token-file``, its clients checked (``grpc_auth.parse_client_tokens``)."""
    from tandem.frontend.grpc_auth import parse_client_tokens

    text = _read_secret(path, "--auth-token-file")
    if text is not None:
        try:
            parse_client_tokens(text, str(path))
        except ValueError as exc:
            raise InvalidRequestError("--auth-token-file", str(exc)) from None
    return text


def port_is_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (a port in TIME_WAIT counts as free, as it does
    for the gRPC server)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _overlap(first: int, other: int, frontends: int) -> bool:
    """Whether ports ``first + i`` and ``other + i`` of ``frontends`` frontends share one."""
    return abs(first - other) < frontends


def run_serve(args: argparse.Namespace) -> int:
    """``tandem serve``: every option checked (an error names its flag) before anything starts."""
    from tandem.cluster.serve import serve

    topology = _serve_topology(args)
    limits, auth_token, http_host = _check_edges(args)
    _check_security_and_autoscaling(args)
    name = _check_deployment(args)
    if args.dry_run:
        from tandem.cli.deployment import run_dry_run

        return run_dry_run(topology, args.address, name)
    _check_ports_free(args, http_host)
    options = _serve_options(args, topology, limits, auth_token, name)
    _warn_exposure(args, http_host, auth_token)
    return serve(options, announce=emit)


def _serve_topology(args: argparse.Namespace) -> Topology:
    """The topology of ``--preset``/``--topology`` with the flags that change it, and its model checked."""
    from tandem.cluster.topology import Topology

    if args.preset is not None and args.topology is not None:
        raise InvalidRequestError("--topology", "cannot be combined with --preset")
    topology = Topology.load(args.topology) if args.topology else Topology.preset(args.preset or "local")
    topology = with_prefill_chunk(args, with_tiers(args, with_speculative(args, topology)))
    if args.autoscale and topology.colocated is not None:
        raise InvalidRequestError(
            "--autoscale",
            f"{topology.name} has a colocated pool; the autoscaler sizes prefill and decode pools",
        )
    if args.model is not None and not (args.model / "config.json").is_file():
        raise InvalidRequestError("--model", f"{args.model} holds no config.json")
    topology = fit_v4_deployment(topology, args.model)
    # tokenizer and tensors too: a rank must not be the first to find out
    check_deployment_model(args.model)
    check_drafter_model(topology, args.model)
    return topology


def _check_edges(args: argparse.Namespace) -> tuple[EdgeLimits, str | None, str]:
    """The edges' ports, limits and tokens: ``(limits, auth token, the HTTP API's host)``."""
    if not 0 <= args.port < 65536:
        raise InvalidRequestError("--port", f"must be in [0, 65535], got {args.port}")
    if args.max_running_requests < 1:
        raise InvalidRequestError("--max-running-requests", "must be at least 1")
    if not 0 <= args.migration_wait <= 86_400:
        raise InvalidRequestError(
            "--migration-wait", f"must be in [0, 86400] seconds, got {args.migration_wait}"
        )
    limits = edge_limits(args)  # a bad value is refused here, before anything starts
    auth_token = read_auth_tokens(args.auth_token_file)
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise InvalidRequestError("--metrics-port", f"must be in [0, 65535], got {args.metrics_port}")
    if args.metrics_port is not None and args.metrics_port != 0 and args.metrics_port == args.port:
        raise InvalidRequestError("--metrics-port", f"{args.metrics_port} is the gRPC port (--port) too")
    if args.http_port is not None and not 0 <= args.http_port < 65536:
        raise InvalidRequestError("--http-port", f"must be in [0, 65535], got {args.http_port}")
    if args.http_host is not None and args.http_port is None:
        raise InvalidRequestError("--http-host", "only applies with --http-port")
    http_host = args.http_host if args.http_host is not None else args.host
    if args.http_port and http_host == args.host:
        taken = {"--port": args.port, "--metrics-port": args.metrics_port}
        for flag, port in taken.items():
            if port and _overlap(args.http_port, port, args.frontends):
                raise InvalidRequestError("--http-port", f"{args.http_port} clashes with {flag} {port}")
    return limits, auth_token, http_host


def _check_security_and_autoscaling(args: argparse.Namespace) -> None:
    check_metrics_security(args)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise InvalidRequestError(
            "--tls-key" if args.tls_cert else "--tls-cert", "--tls-cert and --tls-key go together"
        )
    if (args.prometheus_url or args.autoscale_dry_run) and not args.autoscale:
        flag = "--prometheus-url" if args.prometheus_url else "--autoscale-dry-run"
        raise InvalidRequestError(flag, "only applies with --autoscale")
    if args.prometheus_url is not None and not args.prometheus_url.startswith(("http://", "https://")):
        raise InvalidRequestError(
            "--prometheus-url", f"expected http://HOST:PORT, got {args.prometheus_url!r}"
        )
    if args.autoscale and args.prometheus_url is None and shutil.which("prometheus") is None:
        raise InvalidRequestError(
            "--autoscale",
            "no prometheus binary on PATH: install it (apt-get install prometheus) or pass --prometheus-url",
        )


def _check_deployment(args: argparse.Namespace) -> str:
    """The deployment's name, frontends, detaching and TLS files; its name."""
    from tandem.cli.deployment import check_name

    name = check_name(args.name)
    if args.frontends < 1:
        raise InvalidRequestError("--frontends", f"must be at least 1, got {args.frontends}")
    for flag, first in (("--port", args.port), ("--http-port", args.http_port)):
        if first and first + args.frontends - 1 > 65535:
            last = first + args.frontends - 1
            raise InvalidRequestError(
                "--frontends", f"ports {first}..{last} pass 65535 (from {flag} {first})"
            )
    if args.detach and not args.address:
        raise InvalidRequestError("--detach", "needs --address: an embedded Ray ends with this command")
    if args.detach and args.autoscale and args.prometheus_url is None:
        raise InvalidRequestError(
            "--prometheus-url", "--detach --autoscale needs the cluster's Prometheus (this command's ends)"
        )
    for flag in ("--tls-cert", "--tls-key"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None and not Path(path).is_file():
            raise InvalidRequestError(flag, f"{path} is not a readable file")
    return name


def _check_ports_free(args: argparse.Namespace, http_host: str) -> None:
    # the ports the frontends on this machine bind: every one with an embedded Ray, frontend 0's
    # on a cluster (the others' nodes are known only once placed)
    local = 1 if args.address else args.frontends
    binds = (("--port", args.host, args.port), ("--metrics-port", args.host, args.metrics_port))
    for flag, host, first in (*binds, ("--http-port", http_host, args.http_port)):
        for port in range(first, first + local) if first else ():
            if not port_is_free(host, port):
                raise InvalidRequestError(flag, f"{host}:{port} is in use")


def _serve_options(
    args: argparse.Namespace, topology: Topology, limits: EdgeLimits, auth_token: str | None, name: str
) -> ServeOptions:
    from tandem.cluster.serve import ServeOptions

    metrics_port = args.metrics_port if args.metrics_port is not None or not args.autoscale else 0
    return ServeOptions(
        limits=limits,
        topology=topology,
        model_dir=args.model,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        address=args.address,
        model_name=args.model_name,
        auth_token=auth_token,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        max_running_requests=args.max_running_requests,
        migration_wait_s=args.migration_wait,
        metrics_port=metrics_port,
        metrics_token_file=args.metrics_token_file,
        metrics_tls_cert_file=args.metrics_tls_cert,
        metrics_tls_key_file=args.metrics_tls_key,
        autoscale=args.autoscale,
        prometheus_url=args.prometheus_url,
        autoscale_dry_run=args.autoscale_dry_run,
        deployment=name,
        detach=args.detach,
        frontends=args.frontends,
        http_port=args.http_port,
        http_host=args.http_host,
    )


def _warn_exposure(args: argparse.Namespace, http_host: str, auth_token: str | None) -> None:
    from tandem.frontend.grpc_auth import exposure_warning

    hosts = [args.host] + ([http_host] if args.http_port is not None else [])
    for host in dict.fromkeys(hosts):
        warning = exposure_warning(host, bool(args.tls_cert), auth_token is not None)
        if warning is not None:  # every refusal is behind: serving starts now
            print(f"tandem: warning: {warning}", file=sys.stderr)


def check_metrics_security(args: argparse.Namespace) -> None:
    """The metrics endpoints' token and TLS files, refused in one line before anything starts;
    and a warning for metrics served beyond loopback without a token."""
    from tandem.kvtransfer.bind_guard import is_loopback

    if args.metrics_token_file is not None:
        try:
            token = Path(args.metrics_token_file).read_text().strip()
        except OSError as error:
            why = f"cannot read {args.metrics_token_file}: {error.strerror}"
            raise InvalidRequestError("--metrics-token-file", why) from None
        if not token or any(not 33 <= ord(c) < 127 for c in token):
            raise InvalidRequestError(
                "--metrics-token-file",
                f"{args.metrics_token_file} must hold one token of printable ASCII, no space",
            )
    if bool(args.metrics_tls_cert) != bool(args.metrics_tls_key):
        flag = "--metrics-tls-key" if args.metrics_tls_cert else "--metrics-tls-cert"
        raise InvalidRequestError(flag, "--metrics-tls-cert and --metrics-tls-key go together")
    for flag in ("--metrics-tls-cert", "--metrics-tls-key"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None and not Path(path).is_file():
            raise InvalidRequestError(flag, f"{path} is not a readable file")
    if args.metrics_port is None:
        for flag in ("--metrics-token-file", "--metrics-tls-cert"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise InvalidRequestError(flag, "only applies with --metrics-port")
    elif args.metrics_token_file is None and not is_loopback(args.host):
        print(
            f"tandem: warning: metrics on {args.host or 'every interface'} without --metrics-token-file: "
            "they leave out client names and /sd answers 403 (it lists every process's address)",
            file=sys.stderr,
        )


def run_metrics(args: argparse.Namespace) -> int:
    """``tandem metrics prometheus-config``: the scrape configuration, for ``prometheus.yml``."""
    from tandem.metrics.discovery import prometheus_config

    host, sep, port = args.addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequestError("--addr", f"expected HOST:PORT, got {args.addr!r}")
    if not args.scrape_interval > 0:
        raise InvalidRequestError("--scrape-interval", f"must be > 0 seconds, got {args.scrape_interval}")
    config = prometheus_config(
        args.addr,
        args.scrape_interval,
        args.scrape_interval,
        token_file=args.token_file,
        ca_file=args.ca_file,
    )
    emit(config, end="")
    return 0


def run_client(args: argparse.Namespace, sampling: Callable[[argparse.Namespace], SamplingParams]) -> int:
    """``sampling`` reads the generate command's sampling options, validated."""
    import asyncio

    import grpc

    from tandem.client.grpc_client import ClientOptions, run_generate, status, wait_serving
    from tandem.client.prompts import read_prompts_file

    options = ClientOptions(
        args.addr, _read_secret(args.token_file, "--token-file"), args.tls_ca, timeout_s=args.timeout
    )
    try:
        if args.client_command == "health":
            ok = asyncio.run(wait_serving(options, args.wait))
            emit("SERVING" if ok else "NOT_SERVING")
            return 0 if ok else 1
        if args.client_command == "status":
            from tandem.client.grpc_client import client_totals, message_dict

            reply = asyncio.run(status(options, args.check_integrity))
            shown = message_dict(reply)
            totals, reached, missed = asyncio.run(client_totals(options, reply))
            shown["client_totals"] = {"clients": totals, "frontends": reached, "not_reached": missed}
            emit(json.dumps(shown, indent=2))
            return 0
        base = sampling(args)
        if args.concurrency < 1:
            raise InvalidRequestError("--concurrency", f"must be at least 1, got {args.concurrency}")
        if args.prompts_file is not None:
            specs = read_prompts_file(args.prompts_file, base)
        else:
            if not args.text:
                raise InvalidRequestError("text", "is empty")
            specs = [PromptSpec(args.text, None, base)]
        return run_generate(options, specs, args.concurrency, args.stream, args.json)
    except grpc.aio.AioRpcError as exc:
        print(f"tandem: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
