"""A metrics endpoint holds up to whoever reaches its port: idle connections cost no thread and
are closed, their number is capped without shutting the scraper out, a token and TLS guard it,
and without a token beyond loopback it names no client and no process."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tandem.metrics.frontend import FrontendLabels, FrontendMetrics
from tandem.metrics.http import MetricsLimits, MetricsSecurity, MetricsServer


def _metrics() -> FrontendMetrics:
    metrics = FrontendMetrics(FrontendLabels("tiny", "fe"), clients=("alice",))
    return metrics


def _idle(address: tuple[str, int], count: int) -> list[socket.socket]:
    return [socket.create_connection(address, timeout=5) for _ in range(count)]


def test_a_scrape_answers_within_two_seconds_behind_hundreds_of_idle_connections() -> None:
    server = MetricsServer(_metrics().registry, "127.0.0.1", 0)
    threads_before = threading.active_count()
    held = _idle(("127.0.0.1", server.port), 200)
    try:
        start = time.monotonic()
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=2) as reply:
            assert reply.status == 200 and b"tandem_" in reply.read()
        assert time.monotonic() - start < 2.0
        assert threading.active_count() <= threads_before + 1  # no thread per connection
    finally:
        for s in held:
            s.close()
        server.close()


def test_past_the_cap_the_longest_idle_connection_makes_room() -> None:
    server = MetricsServer(_metrics().registry, "127.0.0.1", 0, limits=MetricsLimits(max_connections=8))
    held = _idle(("127.0.0.1", server.port), 20)
    try:
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=2) as reply:
            assert reply.status == 200
        time.sleep(0.2)
        closed = 0
        for s in held:
            s.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                closed += s.recv(1) == b""
        assert closed >= 20 - 8 + 1  # the scrape's own connection took an idle one's place
    finally:
        for s in held:
            s.close()
        server.close()


def test_an_idle_or_endless_head_is_closed() -> None:
    server = MetricsServer(_metrics().registry, "127.0.0.1", 0, limits=MetricsLimits(idle_timeout_s=0.3))
    try:
        (idle,) = _idle(("127.0.0.1", server.port), 1)
        idle.settimeout(3)
        assert idle.recv(1) == b""  # closed by the server after 0.3 s
        (slow,) = _idle(("127.0.0.1", server.port), 1)
        slow.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (64 << 10))
        slow.settimeout(3)
        with pytest.raises(ConnectionError):
            while slow.recv(4096):
                pass
            raise ConnectionResetError
        # keep-alive: two requests on one connection
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=2)
        for _ in range(2):
            conn.request("GET", "/metrics")
            assert conn.getresponse().read().startswith(b"# HELP")
        conn.close()
    finally:
        server.close()


def _self_signed(folder: Path) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def test_a_token_and_tls_guard_every_path(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    (tmp_path / "ca.pem").write_bytes(cert)
    security = MetricsSecurity(token="s3cret", tls_cert_pem=cert, tls_key_pem=key)
    server = MetricsServer(_metrics().registry, "127.0.0.1", 0, discovery=lambda: [], security=security)
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    base = f"https://localhost:{server.port}"
    try:
        for path in ("/metrics", "/sd"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{base}{path}", timeout=5, context=context)
            assert refused.value.code == 401
            wrong = urllib.request.Request(f"{base}{path}", headers={"Authorization": "Bearer nope"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(wrong, timeout=5, context=context)
            assert refused.value.code == 401
            right = urllib.request.Request(f"{base}{path}", headers={"Authorization": "Bearer s3cret"})
            with urllib.request.urlopen(right, timeout=5, context=context) as reply:
                assert reply.status == 200
        with pytest.raises(OSError):  # plain HTTP is not spoken: the server hangs up
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
    finally:
        server.close()


def test_without_a_token_beyond_loopback_no_client_and_no_address_is_shown() -> None:
    metrics = _metrics()
    documents = [{"targets": ["10.0.0.7:9"], "labels": {"tandem_process": "rank"}}]
    open_server = MetricsServer(metrics.registry, "0.0.0.0", 0, discovery=lambda: documents)
    local = MetricsServer(metrics.registry, "127.0.0.1", 0, discovery=lambda: documents)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{open_server.port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        assert "alice" not in text and 'tandem_generation_tokens_total{client=""' in text
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{open_server.port}/sd", timeout=5)
        assert refused.value.code == 403 and b"--metrics-token-file" in refused.value.read()

        with urllib.request.urlopen(f"http://{local.address}/metrics", timeout=5) as reply:
            assert 'client="alice"' in reply.read().decode()
        with urllib.request.urlopen(f"http://{local.address}/sd", timeout=5) as reply:
            assert json.load(reply) == documents
    finally:
        open_server.close()
        local.close()
