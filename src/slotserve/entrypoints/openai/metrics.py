"""Prometheus metrics of the server: engine gauges, token counters, latency histograms."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

from slotserve.engine.protocol import EngineStats
from slotserve.outputs import RequestOutput

logger = logging.getLogger("slotserve")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"slotserve:{name}", doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"slotserve:{name}", doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"slotserve:{name}", doc, list(labels), buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(**labels)

        self.running = gauge("num_requests_running", "Sequences running in the engine")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting for the engine")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use")
        self.kv_blocks = gauge("kv_cache_blocks", "KV cache blocks in the pool")
        self.kv_free_blocks = gauge("kv_cache_free_blocks", "KV cache blocks free (cached prefixes included)")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up")
        self.prefix_queried = gauge("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = Gauge("slotserve:prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache, by "
                                 "tier (memory: the KV cache; disk: read back from --kv-offload-dir)",
                                 ["model_name", "tier"], registry=self.registry)
        self.kv_disk = {name: gauge(f"kv_offload_{name}", doc) for name, doc in (
            ("files", "KV blocks stored in the disk tier"),
            ("bytes_used", "Bytes the disk tier's files take"),
            ("bytes_read", "Bytes read back from the disk tier"),
            ("bytes_written", "Bytes written to the disk tier"),
            ("corrupt_files", "Disk tier files that failed a check on read and were removed"),
            ("write_errors", "Disk tier writes that failed (OSError)"),
            ("dropped_writes", "Evicted blocks not written: the writer's queue was full or the budget pinned"),
            ("evicted_files", "Disk tier files removed to stay within --kv-offload-bytes"))}
        self.spec_proposed = gauge("spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding")
        self.spec_accepted = gauge("spec_decode_num_accepted_tokens", "Proposed tokens the target model kept")
        self.spec_acceptance = gauge("spec_decode_acceptance_rate", "Proposed tokens kept / proposed")
        self.spec_length = gauge("spec_decode_mean_accepted_length",
                                 "Tokens per verifying sequence-step: those kept and its own")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.finished = Counter("slotserve:request_success", "Requests finished, by reason",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        self.total_prompt_tokens = self.total_generation_tokens = 0  # for the periodic log line
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between streamed deltas")
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to last token")
        # From the engine's diagnostics snapshot (engine/diagnostics.py), at each scrape.
        self.queue_depth = Gauge("slotserve:engine_queue_depth", "Items waiting in a queue between the engine's "
                                 "threads", ["model_name", "queue"], registry=self.registry)
        self.thread_cpu = Gauge("slotserve:thread_cpu_share", "A thread's CPU share over the last second (1 = a core)",
                                ["model_name", "process", "thread"], registry=self.registry)
        self.stalled = gauge("engine_stalled", "1 while the watchdog sees the core loop stalled (--stall-timeout)")
        self.replicas_alive = gauge("engine_replicas_alive", "Engine cores serving (of --data-parallel-size)")
        self.steps = _StepHistograms(model_name)
        self.registry.register(self.steps)

    def track(self, request_id: str, prompt_tokens: int) -> RequestTracker:
        return RequestTracker(self, request_id, prompt_tokens)

    def update_engine(self, stats: EngineStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_blocks.set(stats.num_blocks)
        self.kv_free_blocks.set(stats.num_free_blocks)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.prefix_queried.set(stats.prefix_cache_queried_tokens)
        disk_hits = stats.prefix_cache_disk_hit_tokens
        for tier, value in (("memory", stats.prefix_cache_hit_tokens - disk_hits), ("disk", disk_hits)):
            self.prefix_hits.labels(model_name=self.model_name, tier=tier).set(value)
        if stats.kv_disk is not None:
            for name, g in self.kv_disk.items():
                g.set(getattr(stats.kv_disk, name))
        spec = stats.speculation
        self.spec_proposed.set(spec.proposed)
        self.spec_accepted.set(spec.accepted)
        self.spec_acceptance.set(spec.acceptance_rate)
        self.spec_length.set(spec.mean_accepted_length)

    def update_diagnostics(self, engines: list[dict], front_end_threads: list[dict]) -> None:
        """From each engine core's snapshot (one per replica; a gone one's is {"error": ...}): queues summed over
        them, threads by process ("engine", or "engine-<i>" for replica i), the watchdog's stall in any."""
        live = [(i, e) for i, e in enumerate(engines) if "error" not in e]
        queues: dict[str, int] = {}
        for _, engine in live:
            for queue, depth in engine["queues"].items():
                queues[queue] = queues.get(queue, 0) + depth
        for queue, depth in queues.items():
            self.queue_depth.labels(model_name=self.model_name, queue=queue).set(depth)
        processes = [("engine" if len(engines) == 1 else f"engine-{i}", e["threads"]) for i, e in live]
        for process, threads in [*processes, ("front_end", front_end_threads)]:
            for t in threads:
                if t["cpu_share"] is not None:
                    self.thread_cpu.labels(model_name=self.model_name, process=process, thread=t["name"]).set(
                        t["cpu_share"])
        if live:
            self.stalled.set(any(e["watchdog"]["stalled_since"] is not None for _, e in live))
            self.steps.latest = _summed_histograms([e["step_histograms"] for _, e in live])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Token counts and latencies of one HTTP request (all of its prompts and samples)."""

    def __init__(self, metrics: ServerMetrics, request_id: str, prompt_tokens: int) -> None:
        self.metrics, self.request_id, self.prompt_tokens = metrics, request_id, prompt_tokens
        self.completion_tokens = 0
        self.start = self.last = time.monotonic()
        self.first: float | None = None
        self.done = False

    def delta(self, out: RequestOutput) -> None:
        new = sum(len(c.token_ids) for c in out.outputs)
        if not new:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.completion_tokens += new
        self.metrics.generation_tokens.inc(new)
        self.metrics.total_generation_tokens += new

    def finish(self, *reasons: str | None) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.prompt_tokens.inc(self.prompt_tokens)
        self.metrics.total_prompt_tokens += self.prompt_tokens
        e2e = time.monotonic() - self.start
        self.metrics.e2e.observe(e2e)
        logger.debug("request %s: %d prompt tokens, %d generated, finished %s, ttft %.3f s, e2e %.3f s",
                     self.request_id, self.prompt_tokens, self.completion_tokens, ",".join(map(str, reasons)),
                     (self.first or self.start) - self.start, e2e)
        for reason in reasons:
            self.metrics.finished.labels(model_name=self.metrics.model_name, finished_reason=reason or "abort").inc()

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class _StepHistograms:
    """The engine's step histograms, kept cumulative in the engine process and exposed as they were last read:
    the time of each step and of its phases, and the tokens each step computed (vLLM's iteration_tokens_total)."""

    def __init__(self, model_name: str) -> None:
        self.model_name, self.latest = model_name, None

    def collect(self):
        if self.latest is None:
            return
        seconds = HistogramMetricFamily("slotserve:engine_step_seconds", "Engine step time, whole and by phase "
                                        "(schedule, model, sample)", labels=["model_name", "phase"])
        for phase, h in self.latest["seconds"].items():
            seconds.add_metric([self.model_name, phase], _buckets(h), h["sum"])
        yield seconds
        tokens = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens computed per engine step",
                                       labels=["model_name"])
        h = self.latest["tokens"]
        tokens.add_metric([self.model_name], _buckets(h), h["sum"])
        yield tokens


def _summed_histograms(replicas: list[dict]) -> dict:
    """The replicas' step histograms as one engine's: their counts and sums added (the bounds are the same)."""
    def add(hs: list[dict]) -> dict:
        return {"bounds": hs[0]["bounds"], "counts": [sum(c) for c in zip(*(h["counts"] for h in hs), strict=True)],
                "count": sum(h["count"] for h in hs), "sum": sum(h["sum"] for h in hs)}

    first = replicas[0]
    return {"seconds": {phase: add([r["seconds"][phase] for r in replicas]) for phase in first["seconds"]},
            "tokens": add([r["tokens"] for r in replicas])}


def _buckets(h: dict) -> list[tuple[str, int]]:
    return [*((str(bound), count) for bound, count in zip(h["bounds"], h["counts"], strict=True)),
            ("+Inf", h["count"])]
