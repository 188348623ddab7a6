"""Prometheus metrics with vLLM's names under the `pagedserve:` prefix.

Gauges and counters are read from the engine's stats snapshot at scrape time; latency
histograms are observed when a request finishes. Data parallelism: gauges are per
replica, labeled `engine="0"`, `engine="1"`, ... (vLLM's label; one engine: "0"),
counters are summed over the replicas, and `dp_routed_requests` counts the router's
choices by replica and reason (prefix / load / round_robin).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedserve.outputs import RequestOutput

P = "pagedserve:"


class _StatsCollector:
    def __init__(self, get_stats, model_name: str, get_engine_stats=None, get_routed=None) -> None:
        self.get_stats = get_stats  # -> EngineStats (summed over replicas)
        self.get_engine_stats = get_engine_stats or (lambda: [get_stats()])  # -> one per replica
        self.get_routed = get_routed  # -> {(replica, reason): requests} or None
        self.model_name = model_name

    def collect(self):
        s = self.get_stats()
        per_engine = self.get_engine_stats()
        lbl = ["model_name"]
        val = [self.model_name]

        def gauge(name, doc, attr):
            g = GaugeMetricFamily(P + name, doc, labels=lbl + ["engine"])
            for i, e in enumerate(per_engine):
                g.add_metric(val + [str(i)], getattr(e, attr))
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(P + name, doc, labels=lbl)
            c.add_metric(val, v)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", "num_running")
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting")
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = 100%).", "kv_cache_usage")
        yield gauge("kv_blocks_used", "KV blocks in use.", "kv_blocks_used")
        yield gauge("kv_blocks_total", "KV blocks in the cache.", "kv_blocks_total")
        yield gauge("kv_utilization", "Stored tokens / allocated token slots.", "kv_utilization")
        routed = self.get_routed() if self.get_routed is not None else None
        if routed:
            c = CounterMetricFamily(
                P + "dp_routed_requests",
                "Data parallelism: requests sent to each engine, by why (prefix: it held the longest "
                "cached prefix; load: the least loaded; round_robin).",
                labels=lbl + ["engine", "reason"],
            )
            for (i, reason), v in sorted(routed.items()):
                c.add_metric(val + [str(i), reason], v)
            yield c
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries
        )
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Requests preempted for memory.", s.num_preemptions)
        yield counter(
            "kv_audit_failures",
            "Idle-time KV accounting audits that found a leaked or inconsistent block (details on /health).",
            s.kv_audit_failures,
        )
        yield from _kv_offload_metrics(s, gauge, counter)
        yield counter("prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", s.generation_tokens)
        # speculative decoding, vLLM's names and meanings
        yield counter("spec_decode_num_drafts", "Verification steps of one request.", s.spec_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Guessed tokens verified.", s.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Guessed tokens accepted.", s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Guessed tokens accepted, by position in the draft.",
            labels=lbl + ["position"],
        )
        for i, v in enumerate(s.spec_accepted_per_position):
            per_pos.add_metric(val + [str(i)], v)
        yield per_pos


def _kv_offload_metrics(s, gauge, counter):
    """The disk KV tier (--kv-offload-dir): hits and misses in blocks, I/O bytes and seconds
    (mean latency = seconds / blocks), what it holds, failures and errors."""
    yield gauge("kv_offload_enabled", "1 while the disk KV tier is on (0: off, or disabled by an I/O error).", "kv_offload_enabled")
    yield gauge("kv_offload_stored_blocks", "Blocks held by the disk KV tier.", "kv_offload_stored_blocks")
    yield gauge("kv_offload_stored_bytes", "Bytes held by the disk KV tier.", "kv_offload_stored_bytes")
    for name, doc, v in (
        ("kv_offload_hits", "KV blocks served from the disk tier (read back and verified).", s.kv_offload_hit_blocks),
        ("kv_offload_misses", "Full prompt blocks found in neither the memory nor the disk tier.", s.kv_offload_miss_blocks),
        ("kv_offload_failed_blocks", "Blocks the disk tier could not serve (bad checksum, gone, I/O error).", s.kv_offload_failed_blocks),
        ("kv_offload_corrupt_blocks", "Disk-tier entries dropped for a bad header or checksum (torn writes).", s.kv_offload_corrupt_blocks),
        ("kv_offload_written_blocks", "KV blocks written to the disk tier.", s.kv_offload_saved_blocks),
        ("kv_offload_dropped_saves", "Evicted blocks not written (the write queue was full).", s.kv_offload_dropped_saves),
        ("kv_offload_written_bytes", "Bytes written to the disk tier.", s.kv_offload_bytes_written),
        ("kv_offload_read_bytes", "Bytes read from the disk tier.", s.kv_offload_bytes_read),
        ("kv_offload_write_seconds", "Seconds spent writing blocks (off the step loop).", s.kv_offload_write_seconds),
        ("kv_offload_read_seconds", "Seconds spent reading blocks (off the step loop).", s.kv_offload_read_seconds),
        ("kv_offload_errors", "I/O errors of the disk tier (the first one disables it).", s.kv_offload_errors),
    ):
        yield counter(name, doc, v)


class _FrontendCollector:
    """What the HTTP front end has admitted (the --max-queue bound is counted here)."""

    def __init__(self, get_admission, model_name: str, get_stalled=None) -> None:
        self.get_admission = get_admission
        self.model_name = model_name
        self.get_stalled = get_stalled

    def collect(self):
        if self.get_stalled is not None:
            s = GaugeMetricFamily(
                P + "engine_stalled",
                "1 while requests are in flight and no engine step finished for longer than the stall timeout.",
                labels=["model_name"],
            )
            s.add_metric([self.model_name], float(bool(self.get_stalled())))
            yield s
        in_flight, capacity = self.get_admission()
        g = GaugeMetricFamily(
            P + "num_requests_in_flight",
            "Requests admitted by the front end and not finished (tokenizing, waiting or running).",
            labels=["model_name"],
        )
        g.add_metric([self.model_name], in_flight)
        yield g
        if capacity is not None:
            c = GaugeMetricFamily(
                P + "max_requests_in_flight",
                "Admission bound: max_num_seqs + --max-queue; beyond it requests get 503 + Retry-After.",
                labels=["model_name"],
            )
            c.add_metric([self.model_name], capacity)
            yield c


class ServerMetrics:
    def __init__(
        self, get_stats, model_name: str, get_admission=None, get_engine_stats=None, get_routed=None, get_stalled=None
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_StatsCollector(get_stats, model_name, get_engine_stats, get_routed))
        if get_admission is not None:
            self.registry.register(_FrontendCollector(get_admission, model_name, get_stalled))
        self.rejections = Counter(
            P + "request_rejected",
            "Requests refused before reaching the engine, by reason and HTTP status "
            "(overloaded: 503 with Retry-After).",
            ["model_name", "reason", "status"],
            registry=self.registry,
        )
        lat = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Time to first token.", buckets=lat, registry=self.registry
        )
        self.tpot = Histogram(
            P + "time_per_output_token_seconds",
            "Mean time per output token after the first.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.http_requests = Counter(
            P + "http_requests",
            "HTTP responses by endpoint and status (requests the guard refused are in request_rejected_total).",
            ["model_name", "endpoint", "status"],
            registry=self.registry,
        )
        self.timeouts = Counter(
            P + "request_timeouts",
            "Requests aborted at their deadline (--request-timeout or the request_timeout field): 504.",
            ["model_name"],
            registry=self.registry,
        )
        slo_labels = ["model_name", "slo_class", "target"]
        self.slo_attained = Counter(
            P + "slo_attained",
            "Finished requests that met their latency target (target: ttft or tpot), by SLO class.",
            slo_labels,
            registry=self.registry,
        )
        self.slo_missed = Counter(
            P + "slo_missed",
            "Finished requests that missed their latency target (target: ttft or tpot), by SLO class.",
            slo_labels,
            registry=self.registry,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "End-to-end request latency.",
            buckets=lat,
            registry=self.registry,
        )

    _STATUS = {
        "overloaded": "503",
        "shutting_down": "503",
        "unauthorized": "401",
        "body_too_large": "413",
        "body_timeout": "408",
        "too_many_bodies": "503",
    }

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
                 "/score", "/rerank", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics")

    def responded(self, path: str, status: int) -> None:
        """One HTTP response, counted by endpoint (bounded label values) and status."""
        endpoint = path if path in self.ENDPOINTS else ("/v1/responses/{id}" if path.startswith("/v1/responses/") else "other")
        self.http_requests.labels(self.model_name, endpoint, str(status)).inc()

    def timed_out(self) -> None:
        self.timeouts.labels(self.model_name).inc()

    def rejected(self, reason: str) -> None:
        self.rejections.labels(self.model_name, reason, self._STATUS.get(reason, "400")).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        if not isinstance(out.outputs, list):  # a pooling request: its latency is all there is
            self.e2e.observe(m.finished_time - m.arrival_time)
            return
        if m.slo is not None and all(c.finish_reason not in ("abort", "error") for c in out.outputs):
            n = max((len(c.token_ids) for c in out.outputs), default=0)
            for target, met in m.slo_results(n).items():
                (self.slo_attained if met else self.slo_missed).labels(self.model_name, m.slo.label, target).inc()
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            n = max((len(c.token_ids) for c in out.outputs), default=0)
            if n > 1 and m.last_token_time is not None:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
