"""URL media sources (``refengine.multimodal.url_fetch``) against a local HTTP(S) server on
loopback: off by default, the allow list, loopback/private addresses, redirects re-checked,
byte and time limits, TLS verified against the URL's host on the checked address."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from refengine.config import MediaConfig
from refengine.multimodal import url_fetch
from refengine.multimodal.url_fetch import address_refusal, fetch_url
from refengine.types import InvalidRequestError, MediaInput
from tests.refused_ports import refused_port
from tests.unit.media_helpers import load_image
from tests.unit.test_media_sources import DEFAULT, PNG


class Handler(BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:
        self.server.requests.append((self.path, self.headers.get("Host", "")))
        path, query = urlsplit(self.path).path, parse_qs(urlsplit(self.path).query)
        if path.startswith("/chain/"):  # /chain/N?stop=K: redirects to N+1, ..., K, then the image
            step, stop = int(path[7:]), int(query["stop"][0])
            if step < stop:
                return self.reply(302, headers={"Location": f"/chain/{step + 1}?stop={stop}"})
            path = "/img.png"
        route: dict[str, Callable[[], None]] = {
            "/img.png": lambda: self.reply(200, PNG),
            "/redirect": lambda: self.reply(302, headers={"Location": query["to"][0]}),
            "/no-location": lambda: self.reply(302),
            "/loop-a": lambda: self.reply(301, headers={"Location": "/loop-b"}),
            "/loop-b": lambda: self.reply(308, headers={"Location": "/loop-a"}),
            "/big": lambda: self.reply(200, bytes(100_000)),
            "/big-unsized": lambda: self.reply(200, bytes(100_000), sized=False),
            "/big-chunked": self.chunked,
            "/short": lambda: self.reply(200, b"x" * 10, headers={"Content-Length": "1000"}, sized=False),
            "/slow": lambda: self.server.stop.wait(3) or self.reply(200, PNG),
            "/drip": self.drip,
        }
        route.get(path, lambda: self.reply(404))()

    def reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, sized: bool = True) -> None:
        self.send_response(status)
        for name, value in {**({"Content-Length": str(len(body))} if sized else {}), **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def chunked(self) -> None:
        self.protocol_version, self.close_connection = "HTTP/1.1", True
        self.reply(200, b"".join(b"2710\r\n" + bytes(10_000) + b"\r\n" for _ in range(10)) + b"0\r\n\r\n",
                   headers={"Transfer-Encoding": "chunked", "Connection": "close"}, sized=False)

    def drip(self) -> None:  # a byte every 50 ms: each read is quick, the whole is not
        self.reply(200, headers={"Content-Length": "60"}, sized=False)
        while not self.server.stop.wait(0.05):
            self.wfile.write(b"x")
            self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:
        pass


class Server(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests: list[tuple[str, str]] = []
        self.stop = threading.Event()

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients hanging up early is the point of several tests


def serve(server: Server) -> Iterator[Server]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def http_server() -> Iterator[Server]:
    yield from serve(Server())


@pytest.fixture
def base(http_server: Server) -> str:
    return f"http://127.0.0.1:{http_server.server_port}"


def allow(*hosts: str, private: bool = True, **limits: float) -> MediaConfig:
    return MediaConfig(url_allow_hosts=hosts, url_allow_private=private, **limits)  # type: ignore[arg-type]


def fetch_refused(url: str, config: MediaConfig, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        fetch_url(url, config)


def fake_dns(monkeypatch: pytest.MonkeyPatch, table: dict[str, list[str]], public: str = "") -> list[str]:
    """Resolve the names of ``table`` to its addresses; treat ``public`` as a public address."""
    asked: list[str] = []
    real_resolve, real_refusal = url_fetch.resolve_host, url_fetch.address_refusal

    def resolve(host: str, port: int, deadline: float) -> list[str]:
        asked.append(host)
        return table[host] if host in table else real_resolve(host, port, deadline)

    monkeypatch.setattr(url_fetch, "resolve_host", resolve)
    monkeypatch.setattr(url_fetch, "address_refusal", lambda a: None if a == public else real_refusal(a))
    return asked


def test_url_fetching_is_off_by_default(base: str) -> None:
    message = "url media sources are disabled on this server (--media-url-allow HOST enables them)"
    for call in (lambda: fetch_url(base + "/img.png", DEFAULT),
                 lambda: load_image(MediaInput(modality="image", url=base + "/img.png"), DEFAULT)):
        with pytest.raises(InvalidRequestError) as info:
            call()
        assert str(info.value) == message


@pytest.mark.parametrize("url, match", [
    ("ftp://127.0.0.1/img.png", "http or https"), ("file:///etc/passwd", "http or https"),
    ("//127.0.0.1/img.png", "http or https"), ("http:///img.png", "ASCII host"),
    ("http://user:pw@127.0.0.1/img.png", "credentials"), ("http://127.0.0.1\n/img.png", "control"),
    ("http:// 127.0.0.1/", "whitespace"), ("http://[::1/", "malformed"), ("http://127.0.0.1:99999/", "malformed"),
    ("http://exämple.com/", "ASCII host"), ("http://example.com/", "not in the allow list"),
    ("http://cdn.127.0.0.1/", "not in the allow list"), ("http://127.0.0.1.evil.test/", "not in the allow list"),
    ("http://127.0.0.1/" + "a" * 9000, "characters, more than"),
])
def test_urls_outside_the_policy(http_server: Server, url: str, match: str) -> None:
    seen = len(http_server.requests)
    fetch_refused(url, allow("127.0.0.1", "[::1]"), match)
    assert len(http_server.requests) == seen  # refused before any connection


def test_allow_list_is_exact_and_case_insensitive(http_server: Server) -> None:
    port = http_server.server_port
    fetch_refused(f"http://localhost:{port}/img.png", allow("example.com", "sub.localhost"), "not in the allow list")
    assert fetch_url(f"http://LocalHost.:{port}/img.png", allow("LOCALHOST")) == PNG


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.1", "[::ffff:127.0.0.1]", "0.0.0.0"])
def test_loopback_is_refused_without_url_allow_private(http_server: Server, host: str) -> None:
    seen = len(http_server.requests)
    fetch_refused(f"http://{host}:{http_server.server_port}/img.png", allow(host, private=False),
                  r"not a public address")
    assert len(http_server.requests) == seen


def test_fetch_and_load(http_server: Server, base: str) -> None:
    assert fetch_url(base + "/img.png", allow("127.0.0.1")) == PNG
    loaded = load_image(MediaInput(modality="image", url=base + "/img.png", uuid="u1"), allow("127.0.0.1"))
    assert (loaded.format, loaded.num_bytes, loaded.identity) == ("PNG", len(PNG), "uuid:u1")


def test_connects_to_the_checked_address_with_the_url_host(monkeypatch: pytest.MonkeyPatch,
                                                          http_server: Server) -> None:
    asked = fake_dns(monkeypatch, {"img.test": ["::1", "127.0.0.1"]})  # nothing listens on ::1: next address
    assert fetch_url(f"http://img.test:{http_server.server_port}/img.png", allow("img.test")) == PNG
    assert asked == ["img.test"] and http_server.requests[-1] == ("/img.png", f"img.test:{http_server.server_port}")


def test_redirects_are_followed_and_rechecked(monkeypatch: pytest.MonkeyPatch, http_server: Server) -> None:
    port = http_server.server_port
    fake_dns(monkeypatch, {"img.test": ["127.0.0.1"], "internal.test": ["10.0.0.7"]}, public="127.0.0.1")
    config = allow("img.test", "internal.test", "127.0.0.2", "::ffff:10.0.0.1", private=False)
    start = f"http://img.test:{port}"
    assert fetch_url(f"{start}/redirect?to=/img.png", config) == PNG
    assert fetch_url(f"{start}/redirect?to={start}/img.png", config) == PNG
    for target, match in [("http://evil.test/img.png", "'evil.test' is not in the allow list"),
                          ("http://internal.test/img.png", r"10\.0\.0\.7 \(private\)"),
                          (f"http://127.0.0.2:{port}/img.png", r"127\.0\.0\.2 \(loopback\)"),
                          ("http://[::ffff:10.0.0.1]/", r"\(private\)"), ("file:///etc/passwd", "http or https")]:
        fetch_refused(f"{start}/redirect?to={target}", config, match)


def test_redirect_limits(base: str) -> None:
    config = allow("127.0.0.1", url_max_redirects=3)
    assert fetch_url(base + "/chain/0?stop=3", config) == PNG
    fetch_refused(base + "/chain/0?stop=4", config, "more than url_max_redirects=3")
    fetch_refused(base + "/loop-a", config, "in a loop")
    fetch_refused(base + "/redirect?to=/img.png", allow("127.0.0.1", url_max_redirects=0), "url_max_redirects=0")
    fetch_refused(base + "/no-location", config, "without a Location")


def test_body_limits(base: str) -> None:
    config = allow("127.0.0.1", max_bytes=1000)
    fetch_refused(base + "/big", config, "Content-Length 100000 is over max_bytes=1000")
    fetch_refused(base + "/big-unsized", config, "body is more than max_bytes=1000")
    fetch_refused(base + "/big-chunked", config, "body is more than max_bytes=1000")
    fetch_refused(base + "/short", config, "ended after 10 of 1000 bytes")
    assert len(fetch_url(base + "/big-chunked", allow("127.0.0.1"))) == 100_000


@pytest.mark.parametrize("path", ["/slow", "/drip"])
def test_the_whole_fetch_has_one_deadline(base: str, path: str) -> None:
    start = time.monotonic()
    fetch_refused(base + path, allow("127.0.0.1", url_timeout_seconds=0.4), "took over 0.4 s")
    assert time.monotonic() - start < 1.5


def test_failures_are_invalid_requests(monkeypatch: pytest.MonkeyPatch, base: str) -> None:
    fetch_refused(base + "/missing", allow("127.0.0.1"), "HTTP 404")
    with refused_port() as port:
        fetch_refused(f"http://127.0.0.1:{port}/", allow("127.0.0.1"), "ConnectionRefusedError")

    def resolver(host: str, *args: object, **kwargs: object) -> None:
        if host == "stuck.test":
            time.sleep(0.5)
        raise socket.gaierror("no such host")

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    fetch_refused("http://stuck.test/", allow("stuck.test", url_timeout_seconds=0.2), "took over 0.2 s")
    fetch_refused("http://img.test/", allow("img.test"), "gaierror: no such host")


@pytest.mark.parametrize("address, reason", [
    ("127.0.0.1", "loopback"), ("0.0.0.0", "unspecified"), ("169.254.169.254", "link-local"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("100.64.0.1", "not globally routable"), ("224.0.0.1", "multicast"), ("240.0.0.1", "private"),
    ("::1", "loopback"), ("::", "unspecified"), ("fe80::1", "link-local"), ("fc00::1", "private"),
    ("fec0::1", "site-local"), ("ff02::1", "multicast"), ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:10.0.0.1", "private"), ("::ffff:169.254.169.254", "link-local"), ("::ffff:0.0.0.0", "unspecified"),
    ("2002:7f00:1::", "loopback"), ("2002:a00:1::", "private"), ("64:ff9b::a00:1", "reserved"),
    ("localhost", "not an IP address"),
    ("8.8.8.8", None), ("1.1.1.1", None), ("::ffff:8.8.8.8", None), ("2606:4700:4700::1111", None),
])
def test_address_refusal(address: str, reason: str | None) -> None:
    assert address_refusal(address) == reason


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "2", "-subj", "/CN=img.test", "-addext", "subjectAltName=DNS:img.test",
                    "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem")],
                   check=True, capture_output=True, timeout=30)
    return folder / "cert.pem", folder / "key.pem"


@pytest.fixture(scope="module")
def https_server(tls_files: tuple[Path, Path]) -> Iterator[Server]:
    server = Server()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*tls_files)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    yield from serve(server)


def test_https_verifies_the_url_host_on_the_pinned_address(monkeypatch: pytest.MonkeyPatch, https_server: Server,
                                                           tls_files: tuple[Path, Path]) -> None:
    port, config = https_server.server_port, allow("img.test", "127.0.0.1")
    fake_dns(monkeypatch, {"img.test": ["127.0.0.1"]})
    fetch_refused(f"https://img.test:{port}/img.png", config, "CERTIFICATE_VERIFY_FAILED")  # system CAs only
    monkeypatch.setattr(url_fetch, "_tls_context", lambda: ssl.create_default_context(cafile=str(tls_files[0])))
    assert fetch_url(f"https://img.test:{port}/img.png", config) == PNG  # SNI + hostname check on img.test
    assert https_server.requests[-1] == ("/img.png", f"img.test:{port}")
    fetch_refused(f"https://127.0.0.1:{port}/img.png", config, "IP address mismatch|doesn't match")
