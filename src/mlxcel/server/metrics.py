"""Prometheus metrics for /metrics (K2), in a registry owned by one app (no module globals).

Request counters and latency histograms are pushed by the API layer through the `Telemetry`
protocol; engine gauges and counters are read from `EngineStats` at scrape time, so a scrape
costs one consistent snapshot and nothing is double-counted. Beside the `mlxcel_*` families,
llama-server's own `llamacpp:*` names are written as llama-server writes them (`LlamaCppTotals`):
dashboards and llama.cpp's server tests built for llama-server read them unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlxcel.api.context import SequenceRecord
from mlxcel.types import DiffusionStats, DiskCacheStats, EngineStats, HostCacheStats, RecurrentStateStats, Usage

if TYPE_CHECKING:
    from mlxcel.workers.base import WorkerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The app's metrics; implements mlxcel.api.context.Telemetry."""

    def __init__(self, stats: Callable[[], EngineStats | None],
                 worker_stats: Callable[[], list[WorkerStats]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("mlxcel_requests", "Chat completions (and non-streaming /v1/completions) "
                                "finished, streamed or not; cancelled streams are not counted", registry=self.registry)
        self.completion_tokens = Counter("mlxcel_completion_tokens", "Completion tokens of the requests counted "
                                         "in mlxcel_requests_total", registry=self.registry)
        self.prompt_tokens = Counter("mlxcel_prompt_tokens", "Prompt tokens of the requests counted in "
                                     "mlxcel_requests_total", registry=self.registry)
        self.failed = Counter("mlxcel_requests_failed", "Requests (engine sequences, or a reply that failed to "
                              "encode) ended by an error: reason internal (an exception in the request's path, "
                              "logged with its traceback), engine (the engine failed it or its process died) or "
                              "timeout (--decode-timeout)", ["reason"], registry=self.registry)
        self.ttft = Histogram("mlxcel_time_to_first_token_seconds", "Time from submit to the first generated "
                              "token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("mlxcel_inter_token_latency_seconds", "Time between generated tokens",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.registry.register(EngineCollector(stats))
        self._stats = stats
        self.llamacpp = LlamaCppTotals()
        if worker_stats is not None:
            self.registry.register(WorkerCollector(worker_stats))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def record_completed_request(self, usage: Usage) -> None:
        self.requests.inc()
        self.completion_tokens.inc(usage.completion_tokens)
        self.prompt_tokens.inc(usage.prompt_tokens)

    def record_sequence(self, record: SequenceRecord) -> None:
        self.llamacpp.add(record)

    def record_failed_request(self, reason: str) -> None:
        self.failed.labels(reason=reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric; a scrape starts new throughput buckets."""
        return generate_latest(self.registry) + self.llamacpp.render(self._stats()).encode()


class EngineCollector(Collector):
    """Engine state at scrape time: batch occupancy, queue depth, tokens, prefix cache."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # still loading: no engine yet
            return
        yield _gauge("mlxcel_batch_active_sequences", "Sequences in the running batch", stats.active_sequences)
        yield _gauge("mlxcel_batch_max_size", "Request slots (--parallel)", stats.max_batch_size)
        yield _gauge("mlxcel_batch_occupancy", "Running sequences / slots",
                     stats.active_sequences / max(stats.max_batch_size, 1))
        yield _gauge("mlxcel_queue_depth", "Requests waiting for a slot", stats.queue_depth)
        yield _counter("mlxcel_tokens_generated", "Tokens generated by the engine", stats.tokens_generated)
        yield _counter("mlxcel_prompt_tokens_processed", "Prompt tokens computed (cache hits excluded)",
                       stats.prompt_tokens_processed)
        yield _counter("mlxcel_sequences_started", "Engine sequences started", stats.sequences_started)
        yield _counter("mlxcel_sequences_completed", "Engine sequences completed", stats.sequences_completed)
        yield _counter("mlxcel_sequences_aborted", "Engine sequences started, then aborted", stats.sequences_aborted)
        yield from _prefix_cache_metrics(stats)
        yield from _draft_metrics(stats)
        if stats.recurrent_state is not None:
            yield from _recurrent_state_metrics(stats.recurrent_state)
        if stats.diffusion is not None:
            yield from _diffusion_metrics(stats.diffusion)


def _prefix_cache_metrics(stats: EngineStats) -> Iterator[Metric]:
    cache = stats.prefix_cache
    yield _gauge("mlxcel_prefix_cache_enabled", "1 when prefix caching is on", int(cache.is_enabled))
    yield _counter("mlxcel_prefix_cache_hits", "Requests that reused cached blocks", cache.num_hits)
    yield _counter("mlxcel_prefix_cache_misses", "Requests that reused nothing", cache.num_misses)
    yield _counter("mlxcel_prefix_cache_reused_tokens", "Prompt tokens served from the cache", cache.num_reused_tokens)
    yield _counter("mlxcel_prefix_cache_evictions", "Cached blocks evicted for reuse", cache.num_evictions)
    blocks = GaugeMetricFamily("mlxcel_kv_blocks", "KV cache blocks by state", labels=["state"])
    blocks.add_metric(["used"], cache.num_blocks_used)
    blocks.add_metric(["free"], cache.num_blocks_free)
    blocks.add_metric(["cached"], cache.num_blocks_cached)
    yield blocks
    if cache.host is not None:
        yield from _host_cache_metrics(cache.host)
    if cache.disk is not None:
        yield from _disk_cache_metrics(cache.disk)


def _host_cache_metrics(host: HostCacheStats) -> Iterator[Metric]:
    """The prefix cache's host-memory tier (issue 29 point 5); absent when it is off."""
    yield _counter("mlxcel_prefix_cache_host_hits", "Device misses served from host memory", host.num_hits)
    yield _counter("mlxcel_prefix_cache_host_misses", "Device misses host memory could not serve", host.num_misses)
    yield _counter("mlxcel_prefix_cache_host_blocks_stored", "KV blocks copied to host memory", host.num_blocks_stored)
    yield _counter("mlxcel_prefix_cache_host_blocks_loaded", "KV blocks copied back to the device",
                   host.num_blocks_loaded)
    yield _counter("mlxcel_prefix_cache_host_blocks_spilled", "KV blocks evicted from host memory to the disk tier",
                   host.num_blocks_spilled)
    yield _counter("mlxcel_prefix_cache_host_blocks_dropped", "Device evictions not kept (no host row ready)",
                   host.num_blocks_dropped)
    yield _counter("mlxcel_prefix_cache_host_stored_bytes", "Bytes copied to host memory", host.num_bytes_stored)
    yield _counter("mlxcel_prefix_cache_host_loaded_bytes", "Bytes copied back to the device", host.num_bytes_loaded)
    yield _counter("mlxcel_prefix_cache_host_load_seconds", "Engine time issuing host-to-device loads",
                   host.load_seconds)
    yield _gauge("mlxcel_prefix_cache_host_bytes", "Bytes of KV blocks held in host memory", host.size_bytes)
    yield _gauge("mlxcel_prefix_cache_host_capacity_bytes", "--prefix-cache-host-size", host.capacity_bytes)


def _recurrent_state_metrics(pool: RecurrentStateStats) -> Iterator[Metric]:
    """A hybrid model's recurrent-state pool (issue 41); absent for attention-only models."""
    yield _gauge("mlxcel_recurrent_state_bytes", "Bytes of the recurrent-state pool (beside the KV blocks)",
                 pool.num_bytes)
    yield _gauge("mlxcel_recurrent_state_slots", "Slots of the recurrent-state pool", pool.num_slots)
    yield _gauge("mlxcel_recurrent_state_snapshots", "Prefix snapshots of recurrent state held in RAM",
                 pool.num_snapshots)
    yield _counter("mlxcel_recurrent_state_resumed", "Sequences that resumed from a state snapshot", pool.num_resumed)


def _disk_cache_metrics(disk: DiskCacheStats) -> Iterator[Metric]:
    """The prefix cache's disk tier (issue 29); absent when it is off."""
    yield _counter("mlxcel_prefix_cache_disk_hits", "RAM misses served from disk", disk.num_hits)
    yield _counter("mlxcel_prefix_cache_disk_misses", "RAM misses the disk could not serve", disk.num_misses)
    yield _counter("mlxcel_prefix_cache_disk_skipped", "Disk hits recomputed (loading measured slower)",
                   disk.num_skipped)
    yield _counter("mlxcel_prefix_cache_disk_blocks_written", "KV blocks written to disk", disk.num_blocks_written)
    yield _counter("mlxcel_prefix_cache_disk_blocks_read", "KV blocks read from disk", disk.num_blocks_read)
    yield _counter("mlxcel_prefix_cache_disk_written_bytes", "Bytes of KV block files written", disk.num_bytes_written)
    yield _counter("mlxcel_prefix_cache_disk_read_bytes", "Bytes of KV block files read", disk.num_bytes_read)
    yield _counter("mlxcel_prefix_cache_disk_load_seconds", "Time spent loading KV blocks from disk", disk.load_seconds)
    yield _counter("mlxcel_prefix_cache_disk_bad_files", "Block files skipped and deleted (checksum, header, key)",
                   disk.num_bad_files)
    yield _counter("mlxcel_prefix_cache_disk_write_errors", "Block writes failed", disk.num_write_errors)
    yield _counter("mlxcel_prefix_cache_disk_blocks_dropped", "Evicted blocks not saved: the writer was behind",
                   disk.num_blocks_dropped)
    yield _gauge("mlxcel_prefix_cache_disk_bytes", "Bytes of block files in the disk tier's folder", disk.size_bytes)
    yield _gauge("mlxcel_prefix_cache_disk_capacity_bytes", "--prefix-cache-disk-size", disk.capacity_bytes)
    yield _gauge("mlxcel_prefix_cache_disk_writable", "0 once writes failed (RAM-only)", int(disk.is_writable))


def _diffusion_metrics(diffusion: DiffusionStats) -> Iterator[Metric]:
    """The block-diffusion worker (U): blocks committed, denoising steps, deadline misses."""
    yield _counter("mlxcel_block_diffusion_blocks", "Blocks the block-diffusion worker committed", diffusion.num_blocks)
    yield _counter("mlxcel_block_diffusion_denoising_steps", "Denoising forward passes", diffusion.num_steps)
    yield _counter("mlxcel_block_diffusion_timed_out", "Requests past --diffusion-request-timeout (504)",
                   diffusion.num_timed_out)


def _draft_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Speculative decoding (B1-B4): draft tokens verified and accepted, and their ratio."""
    drafts = stats.drafts
    yield _counter("mlxcel_draft_tokens", "Draft tokens verified by the target (speculative decoding)",
                   drafts.num_drafted)
    yield _counter("mlxcel_draft_tokens_accepted", "Draft tokens the target accepted", drafts.num_accepted)
    yield _gauge("mlxcel_draft_acceptance_rate", "Accepted / verified draft tokens (0 before any draft)",
                 drafts.acceptance_rate)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class WorkerCollector(Collector):
    """Side workers (embedding, rerank) at scrape time: requests by outcome and queue depth (spec I, K2)."""

    COUNTERS = (("requests", "num_requests", "Requests accepted into the worker's queue"),
                ("completed", "num_completed", "Requests answered"),
                ("failed", "num_failed", "Requests whose forward failed"),
                ("rejected", "num_rejected", "Requests refused with 503 because the queue was full"),
                ("timed_out", "num_timed_out", "Requests answered 504 after the request timeout"))

    def __init__(self, stats: Callable[[], list[WorkerStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        workers = self._stats()
        if not workers:
            return
        for suffix, attribute, doc in self.COUNTERS:
            family = CounterMetricFamily(f"mlxcel_worker_{suffix}", doc, labels=["worker"])
            for worker in workers:
                family.add_metric([worker.name], getattr(worker, attribute))
            yield family
        yield _worker_gauge("mlxcel_worker_queue_depth", "Requests waiting in the worker's queue", workers,
                            lambda w: w.queue_depth)
        yield _worker_gauge("mlxcel_worker_max_queue_depth", "The queue bound (--embedding-queue-depth)", workers,
                            lambda w: w.max_queue_depth)


def _worker_gauge(name: str, doc: str, workers: list[WorkerStats],
                  value: Callable[[WorkerStats], float]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, doc, labels=["worker"])
    for worker in workers:
        gauge.add_metric([worker.name], value(worker))
    return gauge


@dataclass(slots=True)
class TokenBucket:
    """Tokens, the decode steps they cost and the seconds spent (llama-server's server_metrics::bucket)."""

    num_tokens: int = 0
    num_steps: int = 0  # the first generated token comes with the prompt's logits: no step of its own
    seconds: float = 0.0

    def add(self, num_tokens: int, num_steps: int, seconds: float) -> None:
        self.num_tokens += num_tokens
        self.num_steps += num_steps
        self.seconds += seconds

    def per_second(self) -> float:
        return self.num_steps / self.seconds if self.seconds > 0 else 0.0


class LlamaCppTotals:
    """llama-server's `llamacpp:*` metrics: per-sequence totals pushed by the API layer, engine step
    counts read from `EngineStats`; the throughput gauges cover the time since the previous scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt, self.predict = TokenBucket(), TokenBucket()
        self.prompt_bucket, self.predict_bucket = TokenBucket(), TokenBucket()
        self.num_prompt_cached = 0

    def add(self, record: SequenceRecord) -> None:
        num_steps = max(record.num_predicted_tokens - 1, 0)
        with self._lock:
            for bucket in (self.prompt, self.prompt_bucket):
                bucket.add(record.num_prompt_tokens, record.num_prompt_tokens, record.prompt_s)
            for bucket in (self.predict, self.predict_bucket):
                bucket.add(record.num_predicted_tokens, num_steps, record.decode_s)
            self.num_prompt_cached += record.num_cached_tokens

    def render(self, stats: EngineStats | None) -> str:
        with self._lock:
            counters, gauges = self._items(stats)
            self.prompt_bucket, self.predict_bucket = TokenBucket(), TokenBucket()
        return "".join(_llamacpp_item(name, kind, doc, value)
                       for kind, items in (("counter", counters), ("gauge", gauges)) for name, doc, value in items)

    def _items(self, stats: EngineStats | None) -> tuple[list[tuple[str, str, float]], list[tuple[str, str, float]]]:
        num_steps = stats.num_steps if stats else 0
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", self.prompt.num_tokens),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", self.num_prompt_cached),
            ("prompt_seconds_total", "Total time spent processing prompts", self.prompt.seconds),
            ("tokens_predicted_total", "Number of generation tokens processed", self.predict.num_tokens),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", self.predict.seconds),
            ("n_decode_total", "Total number of engine forward steps", num_steps),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)",
             stats.max_sequence_len if stats else 0),
            # B1-B4 (0 without --draft-kind, as in llama-server without a draft)
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
             stats.drafts.num_drafted if stats else 0),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             stats.drafts.num_accepted if stats else 0),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
             stats.drafts.num_rounds if stats else 0),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", self.prompt_bucket.per_second()),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s", self.predict_bucket.per_second()),
            ("requests_processing", "Number of requests processing", stats.active_sequences if stats else 0),
            ("requests_deferred", "Number of requests deferred", stats.queue_depth if stats else 0),
            ("n_busy_slots_per_decode", "Average number of busy slots per engine forward step",
             (stats.num_busy_slot_steps if stats else 0) / max(num_steps, 1)),
        ]
        return counters, gauges


def _llamacpp_item(name: str, kind: str, doc: str, value: float) -> str:
    # NOTE: written by hand: prometheus_client would name a counter's TYPE line without `_total`
    # and append `_total` to n_tokens_max; llama-server's exact names are the point here.
    return f"# HELP llamacpp:{name} {doc}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {float(value)!r}\n"
