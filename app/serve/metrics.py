"""``GET /metrics``: the server's figures in Prometheus' text format, with the names
llama.cpp's server uses where they mean the same thing (``llamacpp:``), and potluck's own
(``potluck:``) for speculation, time to first token and cluster stages.

prometheus_client writes the format; the figures are read from the engine thread's counters
at each scrape (one collector), except time to first token, a histogram observed as each
request ends.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine_thread import EngineThread

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics(Collector):
    """The registry ``/metrics`` answers from (one a server: tests run several in one process)."""

    def __init__(self, engine: EngineThread) -> None:
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("potluck:time_to_first_token_seconds",
                              "Seconds from a request's start on the engine to its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.registry.register(self)
        engine.on_outcome = lambda outcome: self.ttft.observe(outcome.ttft_s)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        c = dict(self.engine.counters)
        running, waiting = self.engine.waiting()

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield counter("llamacpp:prompt_tokens", "Prompt tokens processed", c["prompt_tokens"] - c["reused_tokens"])
        yield counter("llamacpp:prompt_seconds", "Seconds spent processing prompts", c["prompt_seconds"])
        yield counter("llamacpp:tokens_predicted", "Tokens generated", c["completion_tokens"])
        yield counter("llamacpp:tokens_predicted_seconds", "Seconds spent generating", c["predicted_seconds"])
        yield GaugeMetricFamily("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s",
                                value=_rate(c["prompt_tokens"] - c["reused_tokens"], c["prompt_seconds"]))
        yield GaugeMetricFamily("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s",
                                value=_rate(c["completion_tokens"], c["predicted_seconds"]))
        yield GaugeMetricFamily("llamacpp:requests_processing", "Requests running", value=int(running))
        yield GaugeMetricFamily("llamacpp:requests_deferred", "Requests waiting", value=waiting)
        yield counter("potluck:prompt_tokens_cached", "Prompt tokens whose KV came from a cache", c["reused_tokens"])
        yield counter("potluck:requests", "Requests taken in line", c["requests"])
        yield counter("potluck:requests_completed", "Requests answered to their end", c["completed"])
        yield counter("potluck:requests_refused_busy", "Requests refused with 429 (queue full)", c["refused_busy"])
        yield counter("potluck:requests_failed", "Requests the engine failed", c["failed"])
        yield counter("potluck:draft_tokens", "Tokens drafted by speculation", c["drafted"])
        yield counter("potluck:draft_tokens_accepted", "Drafted tokens the target accepted", c["accepted"])
        session = self.engine.session
        view = session.cluster_view() if session is not None else None
        if view is not None:
            layers = GaugeMetricFamily("potluck:stage_layers", "Layers each cluster stage computes",
                                       labels=["node", "address"])
            traffic = CounterMetricFamily("potluck:stage_bytes", "Bytes sent to and received from each stage",
                                          labels=["node", "address"])
            healthy = GaugeMetricFamily("potluck:stage_up", "1 where a stage answered at the last report",
                                        labels=["node", "address"])
            for s in view.stages:
                labels = [s.node, s.address]
                layers.add_metric(labels, s.layers[1] - s.layers[0])
                traffic.add_metric(labels, s.bytes_total)
                status = self.engine.nodes.get(s.node)
                healthy.add_metric(labels, 1 if status is None or status.state == "ok" else 0)
            yield from (layers, traffic, healthy)
            yield GaugeMetricFamily("potluck:head_layers", "Layers the head computes itself",
                                    value=view.head_layers[1] - view.head_layers[0])


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0
