"""Fetching a ``url`` media source without opening an SSRF hole: the URL policy of ``MediaConfig``.

Rules, for the URL and again for every redirect target (a refusal is an ``InvalidRequestError``
saying what is wrong; no other exception escapes ``fetch_url``):

1. Off unless ``url_allow_hosts`` is non-empty. http or https only; no credentials (``user@``),
   whitespace or control characters; an ASCII host (``xn--`` form); at most ``MAX_URL_CHARS``.
2. The host must equal an allow-list entry (case-insensitive, a trailing dot ignored, any port).
   Exact match only: ``example.com`` does not admit ``cdn.example.com``, which may be delegated
   to or hosted by someone else; list each host.
3. The host is resolved here, once, and refused if *any* of its addresses is not global unicast
   (``address_refusal``: loopback, private, link-local, multicast, reserved, unspecified,
   site-local, shared...; IPv4 inside IPv6, mapped, 6to4, Teredo or NAT64, is judged as the
   IPv4 address it reaches), unless ``url_allow_private``.
4. The TCP connection goes to a checked address; the name is never resolved again, so a DNS
   answer that changes after the check (rebinding) cannot move the fetch. ``Host`` is the URL's
   host; for https, TLS sends it as SNI and verifies the certificate against it
   (``ssl.create_default_context``: system CAs, hostname check). The address only says where to.
5. Redirects (301, 302, 303, 307, 308): at most ``url_max_redirects``, each target checked from
   rule 1 on; a loop is refused at once. Any other status outside 2xx is refused.
6. A ``Content-Length`` over ``max_bytes`` is refused before reading; a body as soon as more
   than ``max_bytes`` arrived, or if it ends short of its ``Content-Length``.
7. ``url_timeout_seconds`` bounds the whole fetch, redirects included: the lookup and every read
   of the response wait only for the time left, so a trickling server cannot stretch it.

Limits: a stuck lookup holds one of 8 resolver threads until the system resolver gives up (with
all 8 stuck, further lookups time out). Each socket operation of the TLS handshake and of sending
the request may wait as long as was left when the connection began; each resolved address is
tried in turn with all the time left. No proxy is used (it would resolve names itself).
``Content-Type`` is not checked: decoding detects the format from the bytes.
"""

from __future__ import annotations

import concurrent.futures
import functools
import http.client
import io
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from refengine.config import MediaConfig
from refengine.types import InvalidRequestError

MAX_URL_CHARS = 8192
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
DEFAULT_PORTS = {"http": 80, "https": 443}
HEADERS = {"User-Agent": "refengine-media-fetch", "Accept": "image/*"}
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_CHUNK = 64 << 10
#: Name lookups run here, so a stuck resolver cannot hold a caller past its deadline.
_RESOLVER = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="media-url-resolve")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def check_url(url: str, config: MediaConfig) -> None:
    """Rules 1 and 2 for ``url``, without the network (``fetch_url`` checks them again)."""
    if not config.url_allow_hosts:
        raise InvalidRequestError("url media sources are disabled on this server (--media-url-allow HOST enables them)")
    _parse(url, config)


def fetch_url(url: str, config: MediaConfig) -> bytes:
    """The body of ``url``, fetched under ``config``'s URL policy (see the module docstring)."""
    check_url(url, config)
    deadline = time.monotonic() + config.url_timeout_seconds
    current, seen = url, {url}
    try:
        for _ in range(config.url_max_redirects + 1):
            result = _get(current, config, deadline)
            if isinstance(result, bytes):
                return result
            if result in seen:
                raise InvalidRequestError(f"media url {_shown(url)} redirects in a loop (back to {_shown(result)})")
            current = result
            seen.add(result)
    except InvalidRequestError:
        raise
    except TimeoutError:
        raise InvalidRequestError(f"fetching {_shown(current)} took over {config.url_timeout_seconds} s") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise InvalidRequestError(f"fetching {_shown(current)} failed ({type(exc).__name__}: {exc})") from None
    raise InvalidRequestError(f"media url {_shown(url)} redirects more than "
                              f"url_max_redirects={config.url_max_redirects} times")


def address_refusal(address: str) -> str | None:
    """Why a fetch from ``address`` is refused without ``url_allow_private``: ``"loopback"``,
    ``"private"``, ... (None: a global unicast address)."""
    ip = _ip(address)
    if ip is None:
        return "not an IP address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _category(ip.ipv4_mapped)
    for reached in (ip, *_embedded_ipv4(ip)):
        reason = _category(reached)
        if reason is not None:
            return reason
    return None


def _ip(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _category(ip: IPAddress) -> str | None:
    checks = (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
              ("multicast", ip.is_multicast), ("private", ip.is_private), ("reserved", ip.is_reserved),
              ("site-local", isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local),
              ("not globally routable", not ip.is_global))
    return next((name for name, hit in checks if hit), None)


def _embedded_ipv4(ip: IPAddress) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address leads to (6to4, Teredo server and client, NAT64)."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return ()
    nat64 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None
    return tuple(v4 for v4 in (ip.sixtofour, *(ip.teredo or ()), nat64) if v4 is not None)


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int
    path: str  # path and query: what the request line carries


def _parse(url: str, config: MediaConfig) -> _Target:
    """``url`` split and checked against rules 1 and 2."""
    if len(url) > MAX_URL_CHARS:
        raise InvalidRequestError(f"media url is {len(url)} characters, more than {MAX_URL_CHARS}")
    if any(char <= " " or char == "\x7f" for char in url):
        raise InvalidRequestError(f"media url {_shown(url)} contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidRequestError(f"media url {_shown(url)} is malformed ({exc})") from None
    if parts.scheme not in DEFAULT_PORTS:
        raise InvalidRequestError(f"media url scheme must be http or https, got {parts.scheme or 'none'!r}")
    if "@" in parts.netloc:
        raise InvalidRequestError(f"media url {_shown(url)} must not carry credentials (user@host)")
    host = (parts.hostname or "").removesuffix(".")
    if not host or not host.isascii():
        raise InvalidRequestError(f"media url {_shown(url)} needs an ASCII host name (xn-- form if international)")
    if host not in {entry.strip("[]").lower().removesuffix(".") for entry in config.url_allow_hosts}:
        raise InvalidRequestError(f"media url host {host!r} is not in the allow list (--media-url-allow)")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(parts.scheme, host, port or DEFAULT_PORTS[parts.scheme], path)


def _get(url: str, config: MediaConfig, deadline: float) -> bytes | str:
    """One request: the body of a 2xx response, or the absolute URL a redirect points to."""
    target = _parse(url, config)
    addresses = _checked_addresses(target.host, target.port, config, deadline)
    connection = _PinnedConnection(target, addresses, deadline)
    response: http.client.HTTPResponse | None = None
    try:
        connection.request("GET", target.path, headers=HEADERS)
        response = connection.getresponse()
        if response.status in REDIRECT_STATUSES:
            location = response.getheader("Location", "").strip()
            if not location:
                raise InvalidRequestError(f"fetching {_shown(url)}: HTTP {response.status} redirect without a Location")
            return urljoin(url, location)
        if not 200 <= response.status < 300:
            raise InvalidRequestError(f"fetching {_shown(url)} failed: HTTP {response.status} {response.reason}")
        return _read_body(response, config.max_bytes, url)
    finally:
        if response is not None:
            response.close()
        connection.close()


def _checked_addresses(host: str, port: int, config: MediaConfig, deadline: float) -> list[str]:
    """``host``'s addresses, every one of them public unless ``url_allow_private`` (rule 3)."""
    addresses = resolve_host(host, port, deadline)
    for address in addresses:
        reason = None if config.url_allow_private else address_refusal(address)
        if reason is not None:
            raise InvalidRequestError(f"media url host {host!r} resolves to {address} ({reason}), "
                                      "not a public address; refused")
    return addresses


def _read_body(response: http.client.HTTPResponse, max_bytes: int, url: str) -> bytes:
    declared = response.length  # Content-Length as http.client parsed it (None: chunked or until close)
    if declared is not None and declared > max_bytes:
        raise InvalidRequestError(f"fetching {_shown(url)}: Content-Length {declared} is over max_bytes={max_bytes}")
    body = bytearray()
    while chunk := response.read(min(_CHUNK, max_bytes + 1 - len(body))):
        body += chunk
        if len(body) > max_bytes:
            raise InvalidRequestError(f"fetching {_shown(url)}: the body is more than max_bytes={max_bytes}")
    if declared is not None and len(body) < declared:
        raise InvalidRequestError(f"fetching {_shown(url)}: the body ended after {len(body)} of {declared} bytes")
    return bytes(body)


def resolve_host(host: str, port: int, deadline: float) -> list[str]:
    """The addresses ``host`` resolves to, in the resolver's order, within the deadline."""
    if _ip(host) is not None:
        return [host]
    lookup = _RESOLVER.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    infos = lookup.result(timeout=_remaining(deadline))  # TimeoutError when the resolver is slow
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the fetch deadline passed")
    return left


def _connect(addresses: list[str], port: int, deadline: float) -> socket.socket:
    """A TCP socket to the first of ``addresses`` that accepts (numeric: nothing is resolved)."""
    error: OSError = OSError("no address to connect to")
    for address in addresses:
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect((address, port))
            return sock
        except OSError as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise
            error = exc
    raise error


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # system CAs, certificate and host name verified


class _PinnedConnection(http.client.HTTPConnection):
    """A connection for ``target`` whose socket goes to the checked ``addresses`` (TLS for https)."""

    def __init__(self, target: _Target, addresses: list[str], deadline: float) -> None:
        super().__init__(target.host, target.port)
        self.default_port = DEFAULT_PORTS[target.scheme]  # the Host header leaves out the scheme's own port
        self._target, self._addresses, self._deadline = target, addresses, deadline
        self.response_class = functools.partial(_DeadlineResponse, deadline=deadline)

    def connect(self) -> None:
        sock = _connect(self._addresses, self._target.port, self._deadline)
        if self._target.scheme == "https":  # a failed handshake closes the socket
            sock = _tls_context().wrap_socket(sock, server_hostname=self._target.host)
        self.sock = sock


class _DeadlineResponse(http.client.HTTPResponse):
    """A response whose every socket read waits only for the time left before ``deadline``."""

    def __init__(self, sock: socket.socket, *args: Any, deadline: float, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp = io.BufferedReader(_DeadlineIO(sock, self.fp.detach(), deadline))


class _DeadlineIO(io.RawIOBase):
    def __init__(self, sock: socket.socket, raw: io.RawIOBase, deadline: float) -> None:
        super().__init__()
        self._sock, self._raw, self._deadline = sock, raw, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int | None:
        self._sock.settimeout(_remaining(self._deadline))
        return self._raw.readinto(buffer)

    def close(self) -> None:  # the socket itself closes once this and the connection have closed
        self._raw.close()
        super().close()


def _shown(url: str) -> str:
    return repr(url if len(url) <= 200 else url[:200] + "...")
