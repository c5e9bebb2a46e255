"""Prometheus metrics of one gateway: requests, latency, tokens, sessions, errors, merges.

Each app gets its own ``CollectorRegistry`` so several gateways (tests, benchmarks) can live in
one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "areal_gateway_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "areal_gateway_request_seconds",
            "request latency by route",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "areal_gateway_tokens", "tokens by kind (prompt, completion)", ["kind"], registry=r
        )
        self.errors = Counter(
            "areal_gateway_errors", "error responses by type", ["type"], registry=r
        )
        self.sessions_active = Gauge(
            "areal_gateway_sessions_active", "open episode sessions", registry=r
        )
        self.sessions = Counter(
            "areal_gateway_sessions",
            "episode sessions by event (created, ended)",
            ["event"],
            registry=r,
        )
        self.turns = Counter("areal_gateway_turns", "turns recorded into episodes", registry=r)
        self.history_merges = Counter(
            "areal_gateway_history_merges",
            "calls whose prompt continued an earlier turn's sampled ids token-exactly",
            registry=r,
        )
        self.history_splits = Counter(
            "areal_gateway_history_splits",
            "calls that repeated an earlier turn but had to be re-tokenized, by reason",
            ["reason"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
