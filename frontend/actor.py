"""The frontend actor: a named async Ray actor hosting the gRPC server, and optionally the
OpenAI-compatible HTTP server (``openai_http``, uvicorn on this actor's event loop), around a
:class:`FrontendCore`. Ranks push it their token streams and KV events; a refresh task keeps its
view of the cluster and its health service current.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any

import ray

from tandem.engine.cpu_affinity import check_cores, pin_process
from tandem.engine.process_place import this_place
from tandem.frontend.core import FrontendConfig, FrontendCore, StreamBuffer
from tandem.frontend.diagnostics import GcClock, LoopProfiler, ProcessClock, ProfileRow, read_clock, tune_gc
from tandem.frontend.grpc_auth import exposure_warning
from tandem.frontend.grpc_service import build_server, set_serving
from tandem.frontend.openai_http import HttpConfig, OpenAIServer
from tandem.frontend.rank_channel import last_line
from tandem.frontend.running import GenerateSpec
from tandem.metrics.discovery import sd_document
from tandem.metrics.http import MetricsServer
from tandem.wire.routing_view import FrontendInfo
from tandem.wire.scrape_target import ScrapeTarget
from tandem.wire.stream_summary import StreamSummary

log = logging.getLogger(__name__)
EVERY_INTERFACE = ("", "0.0.0.0", "::")  # bind addresses others reach at the node's address


@ray.remote(num_cpus=0)
class Frontend:
    """The gRPC server as a named async Ray actor; ranks stream to it, and push it their KV
    events, over the channels it opens to them (``frontend/membership.py``)."""

    def __init__(self, config: FrontendConfig, http: HttpConfig | None = None) -> None:
        self.config = config
        self.core = FrontendCore(config)
        self.http_config = http
        self._http: OpenAIServer | None = None
        self._server: Any = None
        self._health: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._serving: bool | None = None
        self.port = 0
        self._metrics: MetricsServer | None = None
        self._all_metrics = self.core.metrics
        self._profiler = LoopProfiler()
        self._gc_clock = GcClock()

    async def start(self) -> int:
        """Bind the port and start serving (NOT_SERVING until the pools are ready); the port.
        With ``metrics_port`` set, ``/metrics`` and ``/sd`` are served there too. Once only: a
        second call returns the port."""
        if self._server is not None:
            return self.port
        if self.config.cores is not None:  # before gRPC, uvicorn and the listener start threads
            pin_process(check_cores(self.config.cores, "topology.frontend_cores"))
        self._server, self._health, self.port = build_server(self.core)
        config, metrics = self.config, self._all_metrics
        if config.metrics_port is not None and metrics is not None:
            wildcard = config.metrics_host in EVERY_INTERFACE
            self._metrics = MetricsServer(
                metrics.registry,
                config.metrics_host,
                config.metrics_port,
                discovery=self.discovery,
                advertise=ray.util.get_node_ip_address() if wildcard else None,
                security=config.metrics_security,
            )
        await self._server.start()
        if self.http_config is not None:
            self._http = OpenAIServer(self.core, self.http_config)
            await self._http.start()
        hosts = [config.host] + ([self.http_config.host] if self.http_config is not None else [])
        for host in dict.fromkeys(hosts):
            warning = exposure_warning(host, bool(config.tls_cert_file), bool(config.clients))
            if warning is not None:
                log.warning("%s: %s", config.name, warning)
        await self._set_health(False)
        self._tasks.append(asyncio.create_task(self._refresh_loop()))
        # what start-up made (Ray, gRPC, the tokenizer, the HTTP app) lives as long as the process:
        # frozen, no collection walks it again; and a collection waits for 50,000 more objects
        # alive instead of Python's 700 (``diagnostics.GC_THRESHOLD``)
        tune_gc()
        return self.port

    async def ensure_started(self) -> FrontendInfo:
        """Start if not started (Ray restarted this actor after its node or process was lost:
        the new instance serves again, on its new node); what it registers."""
        await self.start()
        return self.info()

    def observe(self, enabled: bool) -> None:
        """Count and observe requests (the default) or not: what ``tandem bench metrics`` compares."""
        self.core.metrics = self._all_metrics if enabled else None

    def metrics_address(self) -> str | None:
        """``host:port`` of ``/metrics`` and ``/sd`` (``None`` when not served)."""
        return self._metrics.address if self._metrics is not None else None

    def http_address(self) -> str | None:
        """``host:port`` of the OpenAI-compatible HTTP server (``None`` when not served), the
        node's address when bound to every interface."""
        if self._http is None or self.http_config is None:
            return None
        host = self.http_config.host
        if host in EVERY_INTERFACE:
            host = this_place().node_address
        return f"[{host}]:{self._http.port}" if ":" in host else f"{host}:{self._http.port}"

    def _metrics_target(self) -> ScrapeTarget | None:
        if self._metrics is None or self._all_metrics is None:
            return None
        return ScrapeTarget(self._metrics.address, "frontend", self._all_metrics.labels.as_dict())

    def info(self) -> FrontendInfo:
        """What this frontend registers with the controller: where its gRPC server listens
        (the node's address when bound to every interface), its metrics and its process."""
        place = this_place()
        host = place.node_address if self.config.host in EVERY_INTERFACE else self.config.host
        return FrontendInfo(self.config.name, f"{host}:{self.port}", place, self._metrics_target())

    def discovery(self) -> list[dict[str, Any]]:
        """The deployment's scrape targets: every registered frontend, the controller and every
        rank of every started group, as the controller's last view lists them (this frontend
        first, before it has registered)."""
        own = self._metrics_target()
        view = self.core.view
        listed = list(view.metrics_targets) if view is not None else []
        targets = [own] if own is not None and own not in listed else []
        return sd_document(targets + listed)

    async def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.core.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.core.ready

    async def generate(self, specs: list[GenerateSpec]) -> list[StreamSummary]:
        """Run requests through the same core as gRPC's ``Generate``, at most
        ``max_running_requests`` at once (the rest wait here, and that wait is their frontend
        queue time); each one's summary, in order (it holds every token). ``tandem generate`` on
        a cluster and the cluster benchmarks send their requests here."""
        slots = asyncio.Semaphore(self.config.max_running_requests)

        async def one(spec: GenerateSpec) -> StreamSummary:
            spec = replace(spec, arrival_s=time.monotonic())  # arrival on this process's clock
            async with slots, contextlib.aclosing(self.core.generate(spec)) as items:
                async for item in items:
                    if isinstance(item, StreamSummary):
                        return item
            raise RuntimeError(f"request {spec.request_id}: the stream ended without a summary")

        return list(await asyncio.gather(*(one(spec) for spec in specs)))

    def stream_buffers(self) -> list[StreamBuffer]:
        """What each running request's stream holds for its client now."""
        return self.core.stream_buffers()

    def submits(self) -> dict[str, int]:
        """Submits to decode ranks so far over their channels (``frontend/rank_channel.py``),
        the ones refused because no channel was open, and the channels open now."""
        return self.core.membership.submits | {"open_channels": self.core.membership.open_channels()}

    async def clock(self) -> ProcessClock:
        """This process's wall and CPU clocks, the event loop thread's CPU clock, and the cyclic
        collector's seconds and collections, now."""
        return read_clock(self._gc_clock)

    async def start_profile(self) -> None:
        """Profile the event loop's thread (gRPC, pushes, streams) until ``stop_profile``."""
        self._profiler.start()

    async def stop_profile(self) -> list[ProfileRow]:
        """The profile since ``start_profile``: each function's own time, largest first."""
        return self._profiler.stop()

    async def stop(self, grace_s: float = 2.0) -> None:
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(ValueError, ray.exceptions.RayError):  # the controller may be gone
            await ray.get_actor(self.config.controller).unregister_frontend.remote(self.config.name)
        if self._server is not None:
            await self._set_health(False)
            await self._server.stop(grace_s)
        if self._http is not None:
            await self._http.stop()
        self.core.membership.close_channels()
        if self._metrics is not None:
            self._metrics.close()

    async def _refresh_loop(self) -> None:
        controller: Any = None
        while True:
            try:
                if controller is None:  # the frontend may start before the controller
                    try:
                        controller = ray.get_actor(self.config.controller)
                        await controller.register_frontend.remote(self.info())
                    except ValueError:
                        self.core.ready = False
                if controller is not None:
                    await self.core.refresh(controller)
            except ray.exceptions.RayError as exc:
                log.warning("refresh failed: %s", last_line(exc))
                self.core.ready, controller = False, None
            except Exception:  # keep refreshing; never leave health SERVING on a frozen view
                log.exception("refresh failed")
                self.core.ready = False
            await self._set_health(self.core.ready)
            await asyncio.sleep(self.config.refresh_s)

    async def _set_health(self, serving: bool) -> None:
        if serving == self._serving:
            return
        await set_serving(self._health, serving)
        self._serving = serving
