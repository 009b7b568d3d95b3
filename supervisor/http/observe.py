"""What the daemon tells about the requests it serves: one log line per request (route, model,
status, tokens, time to first token, total) and Prometheus metrics at GET /metrics.

Routes fill `req.context.usage` / `req.context.ttft` as they learn them; a streamed answer is
logged when its stream closes. Gauges that describe workers (state, restarts, RSS, KV cache,
expert cache) are read from `status` at scrape time, so they are never stale.
"""

from __future__ import annotations

import logging
import time

import falcon
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("kiln.requests")

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_GAPS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, sup):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kiln_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.duration = Histogram("kiln_request_duration_seconds", "Time to answer a request, by route",
                                  ["route"], buckets=_LATENCY, registry=r)
        self.tokens = Counter("kiln_tokens", "Tokens processed: prompt (in) and completion (out)",
                              ["direction"], registry=r)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=_LATENCY, registry=r)
        self.gap = Histogram("kiln_inter_token_seconds", "Between consecutive tokens of one answer",
                             buckets=_GAPS, registry=r)
        self.drafts = Counter("kiln_speculative_tokens", "Prompt-lookup draft tokens checked, by result",
                              ["result"], registry=r)
        r.register(_StatusCollector(sup))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StatusCollector:
    """Worker and router gauges from the supervisor's status, read at scrape time."""

    def __init__(self, sup):
        self.sup = sup

    def describe(self):
        return []

    def collect(self):
        st = self.sup.command("status", {"events": 1})
        up = GaugeMetricFamily("kiln_worker_up", "1 when the worker is running and ready", labels=["worker", "kind"])
        restarts = CounterMetricFamily("kiln_worker_restarts", "Restarts of each worker", labels=["worker"])
        rss = GaugeMetricFamily("kiln_worker_rss_bytes", "Resident memory of each worker process", labels=["worker"])
        kv = GaugeMetricFamily("kiln_kv_cache_bytes", "KV cache memory held by each model worker", labels=["worker"])
        kv_tok = GaugeMetricFamily("kiln_kv_cache_tokens", "Positions held in each model worker's KV caches",
                                   labels=["worker"])
        hits = CounterMetricFamily("kiln_expert_cache_hits", "Expert cache hits (moe-stream)", labels=["worker"])
        misses = CounterMetricFamily("kiln_expert_cache_misses", "Expert cache misses (moe-stream)", labels=["worker"])
        read = CounterMetricFamily("kiln_expert_bytes_read", "Bytes of experts read from disk (moe-stream)",
                                   labels=["worker"])
        for w in st["workers"]:
            name, stats = w["name"], w.get("stats") or {}
            up.add_metric([name, w["kind"]], 1.0 if w["state"] == "running" and w["worker_state"] == "ready" else 0.0)
            restarts.add_metric([name], w["restarts"])
            if w.get("rss_bytes") is not None:
                rss.add_metric([name], w["rss_bytes"])
            mem = stats.get("memory") or {}
            kv_bytes = stats.get("kv_cache_bytes", mem.get("kv_cache_bytes"))
            if kv_bytes is not None:
                kv.add_metric([name], kv_bytes)
            if stats.get("kv_cache_tokens") is not None:
                kv_tok.add_metric([name], stats["kv_cache_tokens"])
            ec = stats.get("expert_cache")
            if ec:
                hits.add_metric([name], ec["hits"])
                misses.add_metric([name], ec["misses"])
                read.add_metric([name], ec["bytes_read"])
        router = st.get("router") or {}
        depth = GaugeMetricFamily("kiln_queue_depth", "Requests admitted and not yet answered, by phase",
                                  labels=["phase"])
        depth.add_metric(["pending"], router.get("pending", 0))
        depth.add_metric(["waiting"], router.get("waiting", 0))
        yield from (up, restarts, rss, kv, kv_tok, hits, misses, read, depth)


class _LoggedStream:
    """A streamed body that logs its request when it closes (finished, failed or abandoned)."""

    def __init__(self, inner, done):
        self.inner, self.done = inner, done

    def __iter__(self):
        return iter(self.inner)

    def close(self):
        try:
            close = getattr(self.inner, "close", None)
            if close:
                close()
        finally:
            self.done()


class RequestLog:
    """Falcon middleware: a log line and metrics for every request."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def process_request(self, req, resp):
        req.context.t0 = time.perf_counter()
        req.context.usage = None
        req.context.ttft = None
        req.context.model = None

    def process_response(self, req, resp, resource, req_succeeded):
        route = req.uri_template or "unmatched"
        if route == "/metrics":
            return
        if resp.stream is not None and not isinstance(resp.stream, _LoggedStream) and route != "/v1/events":
            resp.stream = _LoggedStream(resp.stream, lambda: self._done(req, resp, route))
            return
        self._done(req, resp, route)

    def _done(self, req, resp, route):
        c = req.context
        total = time.perf_counter() - getattr(c, "t0", time.perf_counter())
        status = resp.status_code if hasattr(resp, "status_code") else int(str(resp.status).split()[0])
        self.m.requests.labels(route, str(status)).inc()
        self.m.duration.labels(route).observe(total)
        u = getattr(c, "usage", None)
        if u:
            self.m.tokens.labels("in").inc(u.get("prompt_tokens", 0))
            self.m.tokens.labels("out").inc(u.get("completion_tokens", 0))
            if u.get("draft_tokens"):
                self.m.drafts.labels("accepted").inc(u["accepted_tokens"])
                self.m.drafts.labels("rejected").inc(u["draft_tokens"] - u["accepted_tokens"])
        if getattr(c, "ttft", None) is not None:
            self.m.ttft.observe(c.ttft)
        parts = [f"{req.method} {req.path}", f"status={status}"]
        if getattr(c, "model", None):
            parts.append(f"model={c.model}")
        if u:
            parts.append(f"prompt_tokens={u.get('prompt_tokens', 0)} completion_tokens={u.get('completion_tokens', 0)}")
        if u and u.get("draft_tokens"):
            parts.append(f"draft_accepted={u['accepted_tokens']}/{u['draft_tokens']}")
        if getattr(c, "ttft", None) is not None:
            parts.append(f"ttft_ms={c.ttft * 1000:.0f}")
        parts.append(f"total_ms={total * 1000:.0f}")
        log.info("request " + " ".join(parts))


class MetricsRoute:
    def __init__(self, metrics: Metrics):
        self.m = metrics

    def on_get(self, req, resp):
        resp.data = self.m.render()
        resp.content_type = CONTENT_TYPE_LATEST
        resp.status = falcon.HTTP_200
