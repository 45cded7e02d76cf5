"""The server's Prometheus metrics: what `GET /metrics` shows, fed by the engine after every step.

Owns: one prometheus_client registry per server (two servers in one process do not share it) and
`ServingMetrics.observe`, an AsyncLLM observer run on the engine thread after each step with what the
step did and the engine's numbers. Latencies are the engine's own stamps (time.perf_counter): time to
first token from a sequence's arrival to its first token, inter-token latency between a sequence's
consecutive tokens. A figure not measured yet (the prefix-cache hit rate before any prompt) is NaN.
"""
from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)


class ServingMetrics:
    def __init__(self, model_name: str, layouts: tuple[str, ...]):
        self.registry = r = CollectorRegistry()
        self.layouts = layouts
        label = {"model_name": model_name}

        def gauge(name, doc, labels=()):
            return Gauge(f"phaseflip_{name}", doc, ["model_name", *labels], registry=r)

        def counter(name, doc, labels=()):
            return Counter(f"phaseflip_{name}", doc, ["model_name", *labels], registry=r)

        def histogram(name, doc):
            return Histogram(f"phaseflip_{name}", doc, ["model_name"], buckets=LATENCY_BUCKETS,
                             registry=r).labels(**label)

        self.running = gauge("requests_running", "Sequences running (holding KV blocks).").labels(**label)
        self.waiting = gauge("requests_waiting", "Sequences waiting for a slot.").labels(**label)
        self.kv_used = gauge("kv_blocks_used", "KV blocks held by sequences.").labels(**label)
        self.kv_free = gauge("kv_blocks_free", "KV blocks free (plain or cached-but-unheld).").labels(**label)
        self.kv_total = gauge("kv_blocks_total", "KV blocks in the pool.").labels(**label)
        self.hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens reused from the prefix cache over "
                                                       "prompt tokens (NaN before any).").labels(**label)
        self.layout = gauge("active_layout", "1 for the layout the ranks run now.", ["layout"])
        self.ttft = histogram("time_to_first_token_seconds", "From arrival to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Between a sequence's consecutive tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "From arrival to the last token, per sequence.")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of sequences that got a first "
                                                            "token.").labels(**label)
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.").labels(**label)
        self.finished = counter("requests_finished_total", "Sequences finished, by reason.", ["finish_reason"])
        self.aborted = counter("requests_aborted_total", "Requests aborted before they finished (a dropped "
                                                          "connection, a cancelled stream).").labels(**label)
        self._aborted_seen = 0
        self.flips = counter("flips_total", "Layout flips, by direction and outcome.", ["direction", "ok"])
        self.flip_seconds = histogram("flip_seconds", "Each flip's total time.")
        self.label = label

    def observe(self, outcome, new_flips: list[dict], snapshot: dict) -> None:
        for seq in outcome.sampled:
            if seq.num_output_tokens == 1:
                self.ttft.observe(seq.first_token_time - seq.arrival_time)
                self.prompt_tokens.inc(seq.num_prompt_tokens)
            else:
                self.itl.observe(seq.token_times[-1] - seq.token_times[-2])
        self.generation_tokens.inc(len(outcome.sampled))
        for seq in outcome.finished:
            if seq.token_times:
                self.e2e.observe(seq.token_times[-1])
            self.finished.labels(finish_reason=seq.finish_reason, **self.label).inc()
        for entry in new_flips:
            self.flips.labels(direction=entry["direction"], ok=str(entry["ok"]).lower(), **self.label).inc()
            self.flip_seconds.observe(entry["total_ms"] / 1e3)
        self._state(snapshot)

    def _state(self, s: dict) -> None:
        self.aborted.inc(s["aborted"] - self._aborted_seen)
        self._aborted_seen = s["aborted"]
        self.running.set(s["running"])
        self.waiting.set(s["waiting"])
        self.kv_total.set(s["kv_blocks_total"])
        self.kv_free.set(s["kv_blocks_free"])
        self.kv_used.set(s["kv_blocks_total"] - s["kv_blocks_free"])
        rate = s["prefix_cache"].get("hit_rate")
        self.hit_rate.set(math.nan if rate is None else rate)
        for layout in self.layouts:
            self.layout.labels(layout=layout, **self.label).set(1 if layout == s["active_layout"] else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
