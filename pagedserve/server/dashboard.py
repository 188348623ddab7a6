"""The live view: `/dashboard` (one self-contained page), `/dashboard/state` (its JSON,
documented in docs/dashboard.md) and `/dashboard/stream` (the same document as
server-sent events, one per new engine snapshot).

The engine core publishes a raw snapshot at most every `snapshot_interval_ms`
(core/core_proc.py); `AsyncLLM.snapshot` holds the latest. The document is built from
it here, once per snapshot whatever the number of viewers, in the server's process.

Auth: the data paths go through the server's RequestGuard like the API (`--api-key`);
the page and its static files carry no data and are served without the key (the page
asks for it and sends it as `Authorization: Bearer`), by `_OpenPage`, an outer ASGI
layer that answers only those paths.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mimetypes
import threading
import time
from collections import deque
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from pagedserve.engine.live_view import percentiles, state_view

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
PAGE_FILES = {"dashboard.html", "dashboard.js", "dashboard.css"}
RESEND_S = 1.0  # an unchanged document is sent again (fresh age and latency) this often
LATENCY_WINDOW_S = 60.0
MAX_VIEW_SHARE = 0.05  # building the document takes at most 5% of a core (large caches: fewer updates)


# -- latency -------------------------------------------------------------------------------------
class HistogramLatency:
    """TTFT / TPOT percentiles over the last LATENCY_WINDOW_S seconds, from the server's
    Prometheus histograms (bucket interpolation, as Grafana's histogram_quantile does); the
    whole run's when the window saw no request."""

    def __init__(self, metrics) -> None:
        self.hists = {"ttft": metrics.ttft, "tpot": metrics.tpot}
        self.history: deque = deque()  # (time, {name: (bounds, cumulative counts)})

    @staticmethod
    def _read(hist):
        bounds, counts = [], []
        for metric in hist.collect():
            for s in metric.samples:
                if s.name.endswith("_bucket"):
                    bounds.append(float(s.labels["le"]))
                    counts.append(s.value)
        return bounds, counts

    def __call__(self) -> dict:
        now = time.time()
        cur = {k: self._read(h) for k, h in self.hists.items()}
        self.history.append((now, cur))
        while len(self.history) > 1 and self.history[1][0] <= now - LATENCY_WINDOW_S:
            self.history.popleft()
        old = self.history[0][1]
        out: dict = {"source": "prometheus_histogram", "window_s": LATENCY_WINDOW_S}
        for k, (bounds, counts) in cur.items():
            base = old[k][1]
            win = [c - b for c, b in zip(counts, base)] if base and len(base) == len(counts) else counts
            if not win or win[-1] <= 0:
                win = counts
                out[k] = {"window": "all", **_hist_quantiles(bounds, win)}
            else:
                out[k] = {"window": f"{LATENCY_WINDOW_S:.0f}s", **_hist_quantiles(bounds, win)}
        return out


def _hist_quantiles(bounds, cum, qs=(50, 90, 99)) -> dict:
    total = cum[-1] if cum else 0
    out: dict = {"count": int(total)}
    for q in qs:
        out[f"p{q}"] = None
        if total <= 0:
            continue
        rank = q / 100 * total
        lo_b, lo_c = 0.0, 0.0
        for b, c in zip(bounds, cum):
            if c >= rank:
                if b == float("inf"):
                    out[f"p{q}"] = lo_b
                else:
                    out[f"p{q}"] = lo_b + (b - lo_b) * ((rank - lo_c) / (c - lo_c) if c > lo_c else 1.0)
                break
            lo_b, lo_c = b, c
    return out


class SampleLatency:
    """Exact TTFT / TPOT percentiles over the last `maxlen` finished requests (offline demo)."""

    def __init__(self, maxlen: int = 2000) -> None:
        self.ttft: deque = deque(maxlen=maxlen)
        self.tpot: deque = deque(maxlen=maxlen)
        self.lock = threading.Lock()

    def observe(self, out) -> None:
        m = getattr(out, "metrics", None)
        if m is None or m.first_token_time is None:
            return
        with self.lock:
            self.ttft.append(m.first_token_time - m.arrival_time)
            n = max((len(c.token_ids) for c in out.outputs), default=0)
            if n > 1 and m.last_token_time is not None:
                self.tpot.append((m.last_token_time - m.first_token_time) / (n - 1))

    def __call__(self) -> dict:
        with self.lock:
            return {
                "source": "samples",
                "window_s": None,
                "ttft": {"window": f"last {self.ttft.maxlen}", **percentiles(self.ttft)},
                "tpot": {"window": f"last {self.tpot.maxlen}", **percentiles(self.tpot)},
            }


# -- the document --------------------------------------------------------------------------------
class DashboardState:
    """Builds the /dashboard/state document from the latest snapshot, at most once per
    snapshot (and per `min_rebuild_s` for the latency part when nothing changes)."""

    def __init__(self, get_snapshot, latency=None, model_name: str = "", interval_ms: int = 250) -> None:
        self.get_snapshot = get_snapshot
        self.latency = latency
        self.model_name = model_name
        self.interval_ms = interval_ms
        self._key = None
        self._doc: dict | None = None
        self._json: bytes = b""
        self._built = 0.0
        self._next_build = 0.0
        self.build_seconds = 0.0  # the last build's time
        self.lock = threading.Lock()

    def current(self) -> tuple[object, bytes]:
        """(an identity that changes with the document, its JSON)."""
        snap = self.get_snapshot()
        now = time.time()
        with self.lock:
            stale = snap is not self._key or now - self._built > 1.0
            if self._doc is None or (stale and now >= self._next_build):
                t0 = time.perf_counter()
                lat = self.latency() if self.latency is not None else {}
                doc = state_view(snap, lat, now)
                doc["model"] = self.model_name
                doc["interval_ms"] = self.interval_ms
                self._json = json.dumps(doc, separators=(",", ":")).encode()
                self._doc, self._key, self._built = doc, snap, now
                self.build_seconds = time.perf_counter() - t0
                self._next_build = now + self.build_seconds / MAX_VIEW_SHARE
            return self._key, self._json


# -- routes ---------------------------------------------------------------------------------------
def dashboard_router(state: DashboardState, is_closing=lambda: False, on_request=lambda: None) -> APIRouter:
    """The data routes; `on_request()` runs on the event loop before each one."""
    router = APIRouter()
    poll_s = max(0.02, min(state.interval_ms / 2e3, 0.25))

    @router.get("/dashboard/state")
    async def dashboard_state():
        on_request()
        _, body = await asyncio.to_thread(state.current)
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/stream")
    async def dashboard_stream():
        on_request()

        async def events():
            last, last_sent = object(), 0.0
            while not is_closing():
                key, body = await asyncio.to_thread(state.current)
                now = time.monotonic()
                if key is not last or now - last_sent > RESEND_S:  # a resend doubles as keep-alive
                    last, last_sent = key, now
                    yield b"data: " + body + b"\n\n"
                await asyncio.sleep(poll_s)

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    return router


class _OpenPage:
    """Answers GET /dashboard and /dashboard/static/<file> (no data in them) before any
    auth layer; everything else passes through."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD"):
            path = scope.get("path", "")
            name = None
            if path in ("/dashboard", "/dashboard/"):
                name = "dashboard.html"
            elif path.startswith("/dashboard/static/"):
                name = path.rsplit("/", 1)[-1]
                if name not in PAGE_FILES:
                    name = ""
            if name is not None:
                if not name:
                    await Response(b"not found", 404)(scope, receive, send)
                    return
                body = (STATIC_DIR / name).read_bytes()
                mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
                headers = {
                    "Cache-Control": "no-cache",
                    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:",
                    "X-Content-Type-Options": "nosniff",
                }
                await Response(body, media_type=mime, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_dashboard(app, llm, model_name: str = "", metrics=None) -> bool:
    """Mount the live view on the API app (`build_app` calls this once). Nothing is mounted
    when the engine publishes no snapshots (`--no-dashboard`, snapshot_interval_ms=0)."""
    obs = getattr(getattr(llm, "config", None), "observability", None)
    interval = getattr(obs, "snapshot_interval_ms", 0)
    if interval <= 0 or not hasattr(llm, "snapshot"):
        return False
    serving = getattr(app.state, "serving", None)
    metrics = metrics if metrics is not None else getattr(serving, "metrics", None)
    latency = HistogramLatency(metrics) if metrics is not None and hasattr(metrics, "ttft") else None
    state = DashboardState(lambda: llm.snapshot, latency, model_name, interval)
    start = getattr(llm, "start_output_loop", lambda: None)  # snapshots flow before the first request
    app.include_router(dashboard_router(state, lambda: bool(getattr(serving, "draining", False)), start))
    app.add_middleware(_OpenPage)  # outermost: before the API-key check
    return True


# -- a standalone server (the offline demo) ---------------------------------------------------------
def serve_standalone(
    get_snapshot,
    latency=None,
    model_name: str = "",
    interval_ms: int = 250,
    host: str = "127.0.0.1",
    port: int = 8008,
):
    """Serve the live view alone from a daemon thread (no auth: loopback by default).
    Returns (server, url); `server.should_exit = True` stops it."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI(title="pagedserve dashboard")
    holder: list = []
    state = DashboardState(get_snapshot, latency, model_name, interval_ms)
    app.include_router(dashboard_router(state, lambda: bool(holder) and holder[0].should_exit))
    app.add_middleware(_OpenPage)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    holder.append(server)
    thread = threading.Thread(target=server.run, name="pagedserve-dashboard", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError(f"the dashboard server did not start on {host}:{port}")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
    return server, f"http://{host}:{port}/dashboard"
