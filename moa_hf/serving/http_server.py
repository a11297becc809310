"""The HTTP side of `moa serve`: ASGI guards that run before any handler, and uvicorn with slow-client timeouts.

- `TokenGate`: the bearer token (constant-time compare) checked from the headers, before any of the body is read:
  401 whatever the body (malformed, 100 MB, chunked), and the connection is closed. `HEALTH_PATH` needs no token.
- `BodyLimit`: 413 for bodies over the limit (by Content-Length, or counted while reading).
- `TimedH11Protocol`: uvicorn's h11 protocol with header and body read timeouts (408, then the connection closes);
  passed as uvicorn's `http=` (`uvicorn_config`), no patching of uvicorn.
- `run_server` (`moa serve`) and `ServerThread` (tests, benchmarks).
"""

import hmac
import json
import logging
import socket
import threading
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "HEALTH_PATH",
    "BodyLimit",
    "ServerThread",
    "TimedH11Protocol",
    "TokenGate",
    "disconnected",
    "run_server",
    "send_json",
    "uvicorn_config",
]

logger = logging.getLogger(__name__)

HEALTH_PATH = "/v1/health"


# ---------------------------------------------------------------------------------------------------------------------
# ASGI middlewares: the token before the body, then the body's size
# ---------------------------------------------------------------------------------------------------------------------
class TokenGate:
    """ASGI middleware: every request but `HEALTH_PATH` needs `Authorization: Bearer <token>` (compared in constant
    time), checked from the headers before any of the body is read: 401 whatever the body (the connection is then
    closed, so an unread body is never read)."""

    def __init__(self, app, token: str | None):
        self.app = app
        self.token = token.encode() if token is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.token is None or scope["path"] == HEALTH_PATH:
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), None)
        scheme, _, credentials = (header or b"").strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token):
            return await self.app(scope, receive, send)
        detail = "missing token: send `Authorization: Bearer <token>`" if header is None else "wrong token"
        await send_json(send, 401, detail, [(b"www-authenticate", b"Bearer"), (b"connection", b"close")])


class BodyLimit:
    """ASGI middleware: a 413 for request bodies over `max_bytes` (by Content-Length, or counted while reading)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        close = [(b"connection", b"close")]
        if length is not None:
            if not length.isdigit():
                return await send_json(send, 400, "Content-Length is not a number", close)
            if int(length) > self.max_bytes:
                return await send_json(send, 413, self._message(int(length)), close)
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message)
            total += len(message.get("body", b""))
            more = message.get("more_body", False)
            if total > self.max_bytes:
                return await send_json(send, 413, self._message(total), close)
        return await self.app(scope, _replay(chunks, receive), send)

    def _message(self, size: int) -> str:
        return (
            f"request body of {size} bytes exceeds this server's limit of {self.max_bytes} bytes (--max-request-bytes)"
        )


def _replay(messages: list, receive):
    """An ASGI receive that gives `messages` first, then whatever `receive` gives (e.g. the disconnect)."""
    queue = list(messages)

    async def replayed():
        if queue:
            return queue.pop(0)
        return await receive()

    return replayed


async def send_json(send, status: int, detail: str, headers: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def disconnected(receive) -> None:
    """Returns when the client has gone (the request's body already read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------------------------------------------------------
# uvicorn: slow clients are cut off
# ---------------------------------------------------------------------------------------------------------------------
_TIMEOUT_BODY = json.dumps({"detail": "request timeout: the request was not received in time"}).encode()
_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    + f"content-length: {len(_TIMEOUT_BODY)}\r\n\r\n".encode()
    + _TIMEOUT_BODY
)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with request timeouts: a request's headers must arrive within `header_timeout_s` of
    its first byte (or of the connection), its body within `body_timeout_s` of its headers; else the connection
    gets a 408 (when no answer has started) and is closed. Idle keep-alive connections: uvicorn's
    `timeout_keep_alive`. Pass `TimedH11Protocol.with_timeouts(h, b)` as uvicorn's `http=`."""

    header_timeout_s = 10.0
    body_timeout_s = 20.0

    @classmethod
    def with_timeouts(cls, header_timeout_s: float, body_timeout_s: float) -> type["TimedH11Protocol"]:
        return type(cls.__name__, (cls,), {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})

    def connection_made(self, transport) -> None:
        self._timer, self._phase = None, None
        super().connection_made(transport)
        self._arm("headers", self.header_timeout_s)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._timer is None and self.conn.their_state is h11.IDLE:  # a new request starts
            self._arm("headers", self.header_timeout_s)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body", self.body_timeout_s)
        elif state is not h11.IDLE:  # the whole request is in (or the connection is closing)
            self._disarm()

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _expired(self) -> None:
        phase, self._timer, self._phase = self._phase, None, None
        if self.transport.is_closing():
            return
        cycle = self.cycle if phase == "body" else None
        if cycle is None or not cycle.response_started:
            self.transport.write(_TIMEOUT_408)
        logger.info("closing a connection whose request %s did not arrive in time", phase)
        self.transport.close()


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, **kwargs):
    """uvicorn's `Config` for `app`, with the slow-client timeouts of its `ServingState`'s limits (`app.state.serving`,
    set by `create_app`) and a 5 s keep-alive."""
    import uvicorn

    limits = getattr(getattr(app.state, "serving", None), "limits", TimedH11Protocol)  # (its defaults without one)
    kwargs.setdefault("timeout_keep_alive", 5)
    http = TimedH11Protocol.with_timeouts(limits.header_timeout_s, limits.body_timeout_s)
    return uvicorn.Config(app, host=host, port=port, http=http, **kwargs)


def run_server(state, app, **config_kwargs) -> None:
    """Serve `app` of a `ServingState` with uvicorn (`uvicorn_config(app, **config_kwargs)`) until SIGINT/SIGTERM.
    As soon as the shutdown starts, new sessions get 503 with Retry-After (waiting ones too) while the calls in
    flight finish (up to `timeout_graceful_shutdown`, 30 s by default); then the state closes (its scheduler
    stops)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            state.set_draining(True)
            await super().shutdown(sockets=sockets)

    config_kwargs.setdefault("timeout_graceful_shutdown", 30)
    try:
        DrainingServer(uvicorn_config(app, **config_kwargs)).run()
    finally:
        state.close()


class ServerThread:
    """A uvicorn server for `app` in a background thread on host:port (port 0: a free one); `stop()` ends it and
    `start()` starts it again on the same port (for tests and benchmarks)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app, self.host, self.port, self.log_level = app, host, port, log_level
        self._server = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, app=None, timeout_s: float = 30.0) -> "ServerThread":
        import uvicorn

        if app is not None:
            self.app = app
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then (else 40 ms per response)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn_config(self.app, log_level=self.log_level, timeout_graceful_shutdown=2, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"moa-serve-{self.port}"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start within {timeout_s} s")
            time.sleep(0.01)
        self._sock = sock  # uvicorn serves on this socket object: keep it open until stop()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
        self._sock.close()
        self._server = self._thread = self._sock = None

    def __enter__(self) -> "ServerThread":
        return self if self._server is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
