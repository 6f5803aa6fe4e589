"""``tandem serve``: the cluster (controller + pools) and the gRPC frontends, until interrupted.

Start-up: Ray (embedded, or ``--address``), in a namespace named after the deployment -> refuse
if that deployment already runs -> the controller starts every group -> each frontend binds its
port and waits until both pools are ready -> one "serving" line on stdout. SIGINT or SIGTERM
stops the frontends first (health NOT_SERVING, running calls get a grace period), then the
groups, then Ray. With ``detach`` the command returns once serving and the deployment (named
actors, placement groups, all detached) stays in the cluster until ``tandem stop``.

Frontend 0 runs on the node where ``serve`` runs (its port is bound there); the others are
spread over the cluster, each on ``port + i`` (``metrics_port + i``, ``http_port + i``). With
``http_port`` each frontend serves the OpenAI-compatible HTTP API too (``frontend/openai_http.py``).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tandem.cluster.controller import Controller
from tandem.cluster.memory_plan import sized_topology
from tandem.cluster.rank_spec import MetricsSpec
from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
from tandem.cluster.topology import Topology, TopologyError
from tandem.engine.cpu_affinity import check_cores
from tandem.frontend.actor import Frontend
from tandem.frontend.core import FRONTEND_NAME, FrontendConfig
from tandem.frontend.limits import EdgeLimits
from tandem.frontend.openai_http import HttpConfig
from tandem.frontend.running import GenerateSpec
from tandem.metrics.discovery import prometheus_config
from tandem.metrics.http import MetricsSecurity
from tandem.metrics.prometheus_process import PrometheusProcess
from tandem.model.dtype_names import AUTO, resolved_dtype
from tandem.model.family import read_config
from tandem.wire.request_params import InvalidRequestError, SamplingParams
from tandem.wire.routing_view import CONTROLLER_NAME
from tandem.wire.stream_summary import StreamSummary

DEFAULT_DEPLOYMENT = "tandem"
log = logging.getLogger(__name__)


class DeploymentExists(InvalidRequestError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            "--name",
            f"a deployment named {name!r} already runs on this Ray cluster; "
            f"stop it (tandem stop --name {name}) or choose another name",
        )

    def __reduce__(self) -> tuple[type, tuple[str]]:  # type: ignore[override]
        return (type(self), (self.name,))


def frontend_name(index: int) -> str:
    return f"{FRONTEND_NAME}-{index}"


def demo_model_dir() -> Path:
    """The model ``serve`` runs when given none: the tiny model the project trains on English
    text (``model/train_demo.py``), installed with the package. Read only."""
    import tandem.model  # no torch: the package's __init__ is a docstring

    return Path(tandem.model.__file__).parent / "demo"


@dataclass(frozen=True)
class ServeOptions:
    topology: Topology
    model_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    dtype: str = AUTO  # resolved on each rank (``model/dtype_names.py``)
    address: str | None = None
    model_name: str | None = None
    auth_token: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    max_running_requests: int = 256
    # a stream whose decode rank failed waits this long for one to resume on (``FrontendConfig``)
    migration_wait_s: float = 60.0
    ready_timeout_s: float = 600.0
    metrics_port: int | None = None  # the frontend's /metrics and /sd (0: a free port); None: none
    # every metrics endpoint's bearer token (a file holding it) and TLS (PEM files); None: none
    metrics_token_file: str | None = None
    metrics_tls_cert_file: str | None = None
    metrics_tls_key_file: str | None = None
    autoscale: bool = False  # run the autoscaler (needs metrics_port)
    prometheus_url: str | None = None  # the autoscaler's Prometheus; None: one of our own
    autoscale_dry_run: bool = False  # decide and record, do not act
    scrape_interval_s: float = 5.0  # of the Prometheus started here for the autoscaler
    deployment: str = DEFAULT_DEPLOYMENT  # its Ray namespace; one deployment per name per cluster
    detach: bool = False  # leave it running when the command exits (needs address)
    frontends: int = 1  # frontend actors, each with its own gRPC port
    limits: EdgeLimits = field(default_factory=EdgeLimits)  # the gRPC edge's (frontend/limits.py)
    http_port: int | None = None  # the OpenAI-compatible HTTP API (0: a free port); None: none
    http_host: str | None = None  # where it binds; None: ``host``
    health_interval_s: float = 0.5  # the controller looks at its groups 10 times in this

    def metrics_security(self) -> MetricsSecurity:
        """The token and TLS every metrics endpoint of the deployment is served with (the files
        are read here, where the command runs; the processes get their contents)."""
        token = Path(self.metrics_token_file).read_text().strip() if self.metrics_token_file else ""
        cert = Path(self.metrics_tls_cert_file).read_bytes() if self.metrics_tls_cert_file else b""
        key = Path(self.metrics_tls_key_file).read_bytes() if self.metrics_tls_key_file else b""
        return MetricsSecurity(token, cert, key)

    @property
    def rank_metrics_host(self) -> str | None:
        """Where the controller and the ranks serve metrics: loopback for an embedded Ray, each
        node's own address on a cluster; ``None`` when the deployment serves no metrics."""
        if self.metrics_port is None:
            return None
        return "" if self.address else "127.0.0.1"


class Server:
    """The running service; :meth:`stop` takes it down in order."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.model_dir = options.model_dir or demo_model_dir()
        self.model_name = options.model_name or self.model_dir.name
        self.controller: Any = None
        self.frontends: list[Any] = []
        self.ports: list[int] = []
        self.metrics_address: str | None = None
        self.http_addresses: list[str] = []  # each frontend's OpenAI-compatible API, host:port
        self.prometheus: PrometheusProcess | None = None

    @property
    def frontend(self) -> Any:
        """Frontend 0, on this node."""
        return self.frontends[0] if self.frontends else None

    @property
    def port(self) -> int:
        return self.ports[0] if self.ports else 0

    @property
    def http_address(self) -> str | None:
        """Frontend 0's OpenAI-compatible API, ``host:port`` (``None`` without ``http_port``)."""
        return self.http_addresses[0] if self.http_addresses else None

    def planned_topology(self) -> Topology:
        """The topology the controller gets: with ``gpu_memory_gib``, each pool's ``num_pages``
        from the memory plan (``cluster/memory_plan.py``); a rank that cannot hold the model is
        refused here (``MemoryPlanError``), before anything starts."""
        topology = self.options.topology
        if topology.gpu_memory_gib is None:
            return topology
        cfg = read_config(Path(self.model_dir))
        return sized_topology(topology, cfg, self.rank_dtype)

    @property
    def rank_dtype(self) -> str:
        """The dtype the ranks get: as given, except ``auto`` in a topology sized by GPU memory,
        which is a GPU's (bfloat16) for the plan and the ranks alike; elsewhere ``auto`` goes to
        the ranks, each resolving it by its own device."""
        dtype = self.options.dtype
        if self.options.topology.gpu_memory_gib is None:
            return dtype
        return resolved_dtype(dtype, on_gpu=True)

    def start(self) -> int:
        o = self.options
        listed = o.topology.frontend_cores  # frontend 0 runs on this node: checked before anything starts
        try:
            cores = None if listed is None else check_cores(listed, "frontend_cores")
        except ValueError as exc:
            raise TopologyError(o.topology.name, str(exc)) from None
        topology = self.planned_topology()
        init_ray(o.address, namespace=o.deployment)
        try:
            ray.get_actor(CONTROLLER_NAME)
        except ValueError:
            pass
        else:
            raise DeploymentExists(o.deployment)
        lifetime = "detached" if o.detach else None
        security, ranks_host = o.metrics_security(), o.rank_metrics_host
        # the controller and frontend 0 on this node (a head, typically): the loss of a rank's
        # node must not take them along
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.controller = Controller.options(  # type: ignore[attr-defined]
            name=CONTROLLER_NAME,
            lifetime=lifetime,
            scheduling_strategy=here,
            max_restarts=-1,  # a crashed controller comes back and adopts the running groups
        ).remote(
            topology,
            str(self.model_dir),
            self.rank_dtype,
            health_interval_s=o.health_interval_s,
            model_name=self.model_name,
            metrics=None if ranks_host is None else MetricsSpec(self.model_name, ranks_host, security),
            detached=o.detach,
            deployment=o.deployment,
        )
        try:
            ray.get(self.controller.start.remote())
            for i in range(o.frontends):
                # frontend 0 where the operator started serve; the rest spread over the nodes
                self.frontends.append(
                    self._frontend(i, cores, security, here if i == 0 else "SPREAD", lifetime)
                )
            self.ports = list(ray.get([f.start.remote() for f in self.frontends]))
            if o.http_port is not None:
                self.http_addresses = list(ray.get([f.http_address.remote() for f in self.frontends]))
            self.metrics_address = ray.get(self.frontend.metrics_address.remote())
            ready = ray.get([f.wait_ready.remote(o.ready_timeout_s) for f in self.frontends])
            if not all(ready):
                raise TimeoutError(f"the pools were not ready within {o.ready_timeout_s:.0f} s")
            if o.autoscale:
                self._start_autoscaler()
        except BaseException:
            self.stop()
            raise
        return self.port

    def _frontend(
        self,
        i: int,
        cores: tuple[int, ...] | None,
        security: MetricsSecurity,
        where: Any,
        lifetime: str | None,
    ) -> Any:
        """Frontend ``i``'s actor, on its ports (the given ones + ``i``, or free ones)."""
        o = self.options
        config = FrontendConfig(
            model_dir=str(self.model_dir),
            model_name=self.model_name,
            host=o.host,
            port=o.port + i if o.port else 0,
            max_running_requests=o.max_running_requests,
            migration_wait_s=o.migration_wait_s,
            auth_token=o.auth_token,
            tls_cert_file=o.tls_cert_file,
            tls_key_file=o.tls_key_file,
            name=frontend_name(i),
            metrics=o.metrics_port is not None,
            metrics_host=o.host,
            metrics_port=o.metrics_port + i if o.metrics_port else o.metrics_port,
            metrics_security=security,
            limits=o.limits,
            cores=cores,
        )
        http = None
        if o.http_port is not None:
            http = HttpConfig(
                o.http_host if o.http_host is not None else o.host, o.http_port + i if o.http_port else 0
            )
        return Frontend.options(  # type: ignore[attr-defined]
            name=config.name,
            scheduling_strategy=where,
            lifetime=lifetime,
            max_restarts=-1,  # a lost frontend comes back (the controller starts it)
        ).remote(config, http)

    def _start_autoscaler(self) -> None:
        """The controller's autoscaler, reading the given Prometheus, or one started here that
        scrapes this deployment through its discovery document."""
        o = self.options
        if self.metrics_address is None:
            raise ValueError("autoscale: the deployment serves no metrics (set metrics_port)")
        url = o.prometheus_url
        if url is None:
            config = prometheus_config(
                self.metrics_address,
                o.scrape_interval_s,
                o.scrape_interval_s,
                token_file=o.metrics_token_file,
                ca_file=o.metrics_tls_cert_file,
            )
            self.prometheus = PrometheusProcess(config)
            url = self.prometheus.url
            targets = ray.get(self.frontend.discovery.remote())
            self.prometheus.wait_for_targets(len(targets))  # the autoscaler starts on data
        ray.get(self.controller.start_autoscaler.remote(url, o.autoscale_dry_run))

    def generate(
        self, prompts: list[list[int]], sampling: list[SamplingParams], timeout_s: float = 600.0
    ) -> list[StreamSummary]:
        """Run prompts through the frontend, as gRPC requests run; the summaries in order
        (``GetTimeoutError`` when they are not all done within ``timeout_s``)."""
        pairs = enumerate(zip(prompts, sampling, strict=True))
        specs = [GenerateSpec(f"req-{i}", list(p), s) for i, (p, s) in pairs]
        return list(ray.get(self.frontend.generate.remote(specs), timeout=timeout_s))

    def observe(self, enabled: bool) -> None:
        """Metrics observed in the frontend and every rank, or not (scrapes still answer): the
        two sides of ``tandem bench metrics``, on one cluster."""
        view = ray.get(self.controller.routing_view.remote())
        ranks = [*view.prefill.values(), *view.decode.values()]
        ray.get([self.frontend.observe.remote(enabled), *(r.observe.remote(enabled) for r in ranks)])

    def stop(self) -> None:
        """Frontends first (no new work), then the groups; each step runs even if one before failed."""
        actors = [*self.frontends, self.controller]
        self.frontends, self.controller = [], None
        for actor in actors:
            if actor is None:
                continue
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except Exception as exc:  # already dead or stuck: killing it below is what is left
                log.warning("stopping %s failed: %s", actor, exc)
            finally:
                ray.kill(actor)
        if self.prometheus is not None:
            self.prometheus.stop()
            self.prometheus = None


def serve(options: ServeOptions, announce: Callable[[str], None] = print) -> int:
    """Run until SIGINT or SIGTERM; 0 after a clean shutdown. ``announce`` prints the serving
    and shutting-down lines."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    server = Server(options)
    previous: dict[int, Any] = {}
    detached = False
    try:
        server.start()
        # after Ray's start-up, which installs its own SIGTERM handler in this process
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        metrics = (
            f"; metrics and discovery on http://{server.metrics_address}" if server.metrics_address else ""
        )
        where = ", ".join(f"{options.host}:{port}" for port in server.ports)
        if server.http_addresses:
            where += "; OpenAI-compatible HTTP on " + ", ".join(
                f"http://{a}/v1" for a in server.http_addresses
            )
        name = options.deployment
        how = f"detached; tandem stop --name {name} stops it" if options.detach else "Ctrl-C stops"
        announce(
            f"tandem: serving {server.model_name} on {where} "
            f"({options.topology.describe()}){metrics}; deployment {name}, {how}"
        )
        if options.detach:
            detached = True
            return 0
        while not stop.wait(0.5):
            pass
        announce("tandem: shutting down")
    finally:
        if not detached:
            server.stop()
        shutdown_ray()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
