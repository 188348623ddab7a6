"""Pure ASGI middleware and the HTTP protocol guard.

`RequestGuard` (pure ASGI: Starlette's BaseHTTPMiddleware hides client disconnects from
the app) does, per HTTP request:
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

from pagedserve.server.serving_base import CLEANUP_KEY, error_body

logger = logging.getLogger(__name__)


class RequestGuard:
    def __init__(
        self,
        app,
        api_key: str | None = None,
        max_body_bytes: int = 16 << 20,
        open_paths: tuple[str, ...] = ("/health",),
        on_reject=None,
    ) -> None:
        self.app = app
        self.key = api_key.encode("utf-8") if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = frozenset(open_paths)
        self.on_reject = on_reject or (lambda reason: None)

    # -- checks -------------------------------------------------------------------------------
    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, sep, token = value.partition(b" ")
                return sep == b" " and scheme.lower() == b"bearer" and hmac.compare_digest(token, self.key)
        return False

    @staticmethod
    def _content_length(scope) -> int | None | str:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                v = value.strip()
                return int(v) if v.isdigit() else "bad"
        return None

    async def _reply(self, scope, receive, send, status: int, body: dict, headers=None) -> None:
        await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)

    def _too_large(self) -> dict:
        return error_body(
            f"request body is larger than {self.max_body_bytes} bytes",
            "invalid_request_error",
            None,
            "body_too_large",
        )

    # -- the request ------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.key is not None and scope.get("path") not in self.open_paths and not self._authorized(scope):
            self.on_reject("unauthorized")
            await self._reply(
                scope,
                receive,
                send,
                401,
                error_body("invalid or missing API key", "authentication_error", None, "invalid_api_key"),
                {"WWW-Authenticate": "Bearer"},
            )
            return
        length = self._content_length(scope)
        if length == "bad":
            await self._reply(
                scope, receive, send, 400, error_body("invalid Content-Length", "invalid_request_error")
            )
            return
        if length is not None and length > self.max_body_bytes:
            self.on_reject("body_too_large")
            await self._reply(scope, receive, send, 413, self._too_large())
            return

        # Read the whole body here (bounded, whatever the framing), then replay it.
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > self.max_body_bytes:
                # uvicorn discards the rest of the body once the response is complete
                self.on_reject("body_too_large")
                await self._reply(scope, receive, send, 413, self._too_large())
                return
            if not msg.get("more_body", False):
                break

        disconnected = asyncio.Event()
        replayed = False
        response_complete = False

        async def app_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def app_send(message) -> None:
            nonlocal response_complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_complete = True
            await send(message)

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return

        cleanups = scope.setdefault(CLEANUP_KEY, [])
        task = asyncio.ensure_future(self.app(scope, app_receive, app_send))
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
