"""What the server asks of a request's headers and adds to its response's: the Host allow-list (a
request for another name, as a DNS-rebinding page sends, reaches no endpoint) and the security headers
on every HTTP response (no framing, no MIME sniffing, no referrer, same-origin pages). The widget script
is embedded by other sites' pages; CSP governs documents, so it is unaffected."""

from __future__ import annotations

import ipaddress

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config import ServerSettings
from .metrics import Metrics

HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; connect-src 'self'; img-src 'self' data:; object-src 'none'; "
        b"base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
]

# names every node answers to; IP literals are always allowed (see `HostAllowList.allows`)
LOCAL_NAMES = ("localhost",)
MAX_SHOWN_CHARS = 100  # of a refused Host in the error message


class SecurityHeaders:
    """ASGI wrapper adding `HEADERS` to each HTTP response that does not set them itself."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(name, value) for name, value in HEADERS if name not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def split_host(value: str) -> tuple[str, int | None]:
    """A Host header's name (lower case, brackets and a final dot removed) and port (None: absent or
    unreadable)."""
    value = value.strip().lower()
    port = ""
    if value.startswith("["):  # [v6]:port
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:  # a name, or a bare IPv6 address
        name = value
    return name.rstrip("."), int(port) if port.isdigit() else None


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostAllowList:
    """The names this node answers to: `server.allowed_hosts` ("*": any; "*.shop.example": its
    subdomains), localhost and the listen host."""

    def __init__(self, server: ServerSettings):
        listed = [h.strip().lower().rstrip(".") for h in server.allowed_hosts]
        self.any = "*" in listed
        self.suffixes = tuple(h[1:] for h in listed if h.startswith("*."))
        self.names = {h for h in listed if not h.startswith("*")} | set(LOCAL_NAMES)
        listen = server.host.strip().lower().rstrip(".")
        if listen and not is_ip_literal(listen):  # an address is allowed anyway
            self.names.add(listen)

    def allows(self, host: str | None) -> bool:
        """Whether a request with this Host header may reach an endpoint. A request without one is no
        browser's (HTTP/1.0 health checks); an IP literal is no rebinding page's either: a page's
        requests carry its own origin's name, and a rebinding page's origin is the attacker's name."""
        if host is None or self.any:
            return True
        name = split_host(host)[0]
        if not name:
            return False
        return name in self.names or is_ip_literal(name) or name.endswith(self.suffixes)


def header(scope: Scope, name: bytes) -> str | None:
    """One request header of an ASGI scope (the first, decoded as latin-1), None when absent."""
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class TrustedHosts:
    """ASGI wrapper: an HTTP request or WebSocket handshake whose Host this node does not answer to is
    refused with HTTP 400 `forbidden_host` before any endpoint, so loopback counts as a credential
    only for this node's own names."""

    def __init__(self, app: ASGIApp, server: ServerSettings, metrics: Metrics):
        self.app, self.hosts, self.metrics = app, HostAllowList(server), metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = header(scope, b"host") if scope["type"] in ("http", "websocket") else None
        if self.hosts.allows(host):
            await self.app(scope, receive, send)
            return
        self.metrics.error("forbidden_host")
        shown = (host or "")[:MAX_SHOWN_CHARS]
        message = f"this server does not answer to the host {shown!r} (server.allowed_hosts)"
        error = {"code": "forbidden_host", "message": message, "type": "invalid_request_error", "param": None}
        if scope["type"] == "http" or "websocket.http.response" in scope.get("extensions", {}):
            # a WebSocket handshake too gets the JSON answer, as HTTP 400 instead of the upgrade
            await JSONResponse({"error": error}, status_code=400)(scope, receive, send)
        else:  # a server without the denial-response extension answers 403 itself
            await send({"type": "websocket.close", "code": 1008})
