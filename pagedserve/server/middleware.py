"""Pure ASGI middleware and the HTTP protocol guard.

`RequestGuard` (pure ASGI: Starlette's BaseHTTPMiddleware hides client disconnects from
the app) does, per HTTP request, through the functions below it is made of
(`authorized`, `content_length`, `read_body`, `run_watched`):
  - API-key check on every path but the open ones (/health; /metrics if so configured):
    the `Bearer` scheme matched case-insensitively, the key compared in constant time;
  - the body limit for Content-Length *and* chunked bodies (413);
  - the disconnect watcher: after the body is read it waits on the server's `receive()`
    for `http.disconnect`; if the client leaves before the response is complete it
    cancels the handler (which aborts its engine requests: streaming or not, single or
    list) and runs the request's cleanups (`scope[CLEANUP_KEY]`) whatever the handler
    did. Nothing here depends on how a handler or a response class polls for disconnects.

`HeaderTimeoutH11Protocol` closes connections whose request headers have not arrived
within `header_timeout` seconds (uvicorn itself has no such limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.server.http_errors import error_body, shaped
from pagedserve.server.serving_base import CLEANUP_KEY

logger = logging.getLogger(__name__)


class BodyTooLarge(Exception):
    pass


def authorized(scope, key: bytes) -> bool:
    """An `Authorization: Bearer <key>` header (scheme case-insensitive) or, as Anthropic's
    clients send it, `x-api-key: <key>`; keys compared in constant time."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, sep, token = value.partition(b" ")
            if sep == b" " and scheme.lower() == b"bearer" and hmac.compare_digest(token, key):
                return True
        elif name == b"x-api-key" and hmac.compare_digest(value, key):
            return True
    return False


def reply(scope, status: int, body: dict, headers=None) -> JSONResponse:
    """An error answered by the guard, in the shape of the API at the request's path."""
    return JSONResponse(shaped(scope.get("path", ""), body), status_code=status, headers=headers)


def content_length(scope) -> int | None | str:
    """The declared body length, None if not declared, "bad" if not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            v = value.strip()
            return int(v) if v.isdigit() else "bad"
    return None


async def read_body(receive, limit: int) -> bytes | None:
    """The whole body, whatever its framing (None: the client left first). Raises
    BodyTooLarge past `limit` bytes (uvicorn discards the rest once a response is sent)."""
    body = bytearray()
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body += msg.get("body", b"")
        if len(body) > limit:
            raise BodyTooLarge
        if not msg.get("more_body", False):
            return bytes(body)


async def run_watched(app, scope, receive, send, body: bytes, on_status=None) -> None:
    """Run `app` on the replayed `body` while watching `receive` for the client leaving: a
    client that leaves before the response is complete cancels the handler (which aborts
    its engine requests); the request's cleanups (`scope[CLEANUP_KEY]`) run in any case."""
    disconnected = asyncio.Event()
    replayed = False
    response_complete = False

    async def app_receive():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def app_send(message) -> None:
        nonlocal response_complete
        if message["type"] == "http.response.start" and on_status is not None:
            on_status(message["status"])
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            response_complete = True
        await send(message)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    cleanups = scope.setdefault(CLEANUP_KEY, [])
    task = asyncio.ensure_future(app(scope, app_receive, app_send))
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():  # the watcher saw a disconnect first
            disconnected.set()
            if not response_complete:
                task.cancel()  # the client left: stop the handler (and its engine requests)
            with contextlib.suppress(asyncio.CancelledError):
                await task
        else:
            task.result()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        for fn in cleanups:
            try:
                fn()
            except Exception:  # noqa: BLE001
                logger.exception("request cleanup failed")


class RequestGuard:
    def __init__(
        self,
        app,
        api_key: str | None = None,
        max_body_bytes: int = 16 << 20,
        open_paths: tuple[str, ...] = ("/health",),
        on_reject=None,
        body_timeout: float | None = 30.0,
        max_pending_bodies: int = 256,
        on_response=None,
        slot_wait: float = 5.0,
    ) -> None:
        self.app = app
        self.on_response = on_response  # (path, status): counted by endpoint in /metrics
        self.body_timeout = body_timeout  # headers to the body's last byte (408 past it)
        self.max_pending_bodies = max_pending_bodies
        self.pending_bodies = 0  # requests whose bodies are still arriving (<= max_pending_bodies)
        # A request over the bound waits up to `slot_wait` s for a slot: a burst of fast bodies
        # (a benchmark's 512 requests at once) frees them within milliseconds; only bodies that
        # trickle in hold them (each until body_timeout), and then it gets the 503.
        self.slot_wait = slot_wait
        self._slots: asyncio.Semaphore | None = None  # made on the server's loop
        self.key = api_key.encode("utf-8") if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = frozenset(open_paths)
        self.on_reject = on_reject or (lambda reason: None)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await reply(scope, refusal[0], refusal[1], refusal[2])(scope, receive, send)
            return
        if not await self._take_slot():
            self.on_reject("too_many_bodies")
            body = error_body("too many requests are still sending their bodies; retry later", "server_error", None, "server_overloaded")
            await reply(scope, 503, body, {"Retry-After": "1"})(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(read_body(receive, self.max_body_bytes), self.body_timeout)
        except BodyTooLarge:
            self.on_reject("body_too_large")
            await reply(scope, 413, self._too_large())(scope, receive, send)
            return
        except asyncio.TimeoutError:
            self.on_reject("body_timeout")
            msg = f"the request body did not arrive within {self.body_timeout:g} s"
            body = error_body(msg, "invalid_request_error", None, "body_timeout")
            await reply(scope, 408, body, {"Connection": "close"})(scope, receive, send)
            return
        finally:
            self._free_slot()
        if body is not None:
            path = scope.get("path", "")
            status = None if self.on_response is None else (lambda code: self.on_response(path, code))
            await run_watched(self.app, scope, receive, send, body, status)

    async def _take_slot(self) -> bool:
        """Count this request's body as arriving; False when no slot freed within slot_wait."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_pending_bodies)
        try:
            if self._slots.locked():
                await asyncio.wait_for(self._slots.acquire(), self.slot_wait)
            else:  # the usual case: no timer, no task
                await self._slots.acquire()
        except asyncio.TimeoutError:
            return False
        self.pending_bodies += 1
        return True

    def _free_slot(self) -> None:
        self.pending_bodies -= 1
        self._slots.release()

    def _refusal(self, scope) -> tuple[int, dict, dict | None] | None:
        """(status, body, headers) to answer before reading the body, or None."""
        if self.key is not None and scope.get("path") not in self.open_paths and not authorized(scope, self.key):
            self.on_reject("unauthorized")
            body = error_body("invalid or missing API key", "authentication_error", None, "invalid_api_key")
            return 401, body, {"WWW-Authenticate": "Bearer"}
        length = content_length(scope)
        if length == "bad":
            return 400, error_body("invalid Content-Length", "invalid_request_error"), None
        if length is not None and length > self.max_body_bytes:
            self.on_reject("body_too_large")
            return 413, self._too_large(), None
        return None

    def _too_large(self) -> dict:
        return error_body(
            f"request body is larger than {self.max_body_bytes} bytes", "invalid_request_error", None, "body_too_large"
        )


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a limit on how long a client may take to send a
    request's headers (a new connection, or the next request on a kept-alive one)."""

    header_timeout: float = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not None and not self.cycle.response_complete:
            self._header_timer.cancel()  # a request's headers are in
            self._header_timer = None

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served
        if not self.transport.is_closing():
            logger.info(
                "closing a connection that sent no complete request headers in %.0f s", self.header_timeout
            )
            self.transport.close()


def header_timeout_protocol(seconds: float) -> type:
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": seconds})
