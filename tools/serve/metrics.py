"""/metrics of `framekv serve`: a `StreamScheduler`'s counters as Prometheus series.

Each app has its own ``CollectorRegistry`` (`metrics_registry`) holding one collector
that reads `StreamScheduler.metrics` at every scrape, so several apps in one process
(tests) never share a series and nothing is counted twice::

    framekv_sessions                 gauge      sessions open
    framekv_session_slots            gauge      sessions allowed open at once
    framekv_pool_slots               gauge      sessions the pool holds at once (--slots)
    framekv_sessions_resident        gauge      open sessions holding a pool slot
    framekv_sessions_swapped         gauge      open sessions swapped out to host memory
    framekv_swapped_bytes            gauge      host bytes the swapped-out streams hold
    framekv_pool_bytes               gauge      the K/V pool's mapped bytes
    framekv_gpu_allocated_bytes      gauge      torch's allocated CUDA bytes as of the last
                                                step (CUDA only; no route calls into CUDA)
    framekv_steps_total              counter    batched steps
    framekv_failed_steps_total       counter    steps that raised
    framekv_failed_resets_total      counter    failed steps whose rows could not be
                                                started over (retried later)
    framekv_chunks_total             counter    chunks made (all sessions)
    framekv_swap_outs_total          counter    sessions swapped out of the pool
    framekv_swap_ins_total           counter    sessions swapped back in (restored)
    framekv_swap_bytes_total         counter    host bytes the swaps moved, both ways
    framekv_failed_swaps_total       counter    swaps that raised (their session failed)
    framekv_graph_replays_total      counter    whole-chunk graph replays
    framekv_graph_captures_total     counter    graphs captured
    framekv_video_frames_total       counter    video frames decoded (decoding only)
    framekv_sessions_ended_total     counter    sessions closed, label reason (deleted,
                                                idle, disconnected, done, failed, ...)
    framekv_step_seconds             histogram  a batched step, its decode included
    framekv_chunk_seconds            histogram  a chunk's latency: its session ready
                                                for it -> it is queued
    framekv_swap_seconds             histogram  one swap out or in, its copies waited for
    framekv_input_frames_total       counter    video sessions' input frames received
    framekv_input_frames_dropped_total counter  input frames dropped (newer came first)
    framekv_input_latency_seconds    histogram  a chunk's newest input frame received to
                                                the chunk handed out to be sent

`render` writes them in the format the scraper's ``Accept`` asks for (Prometheus text,
or OpenMetrics) with prometheus_client's content type. Every series is a fixed-size
snapshot (histograms are bucket counts, the reasons a fixed vocabulary), so a scrape's
size does not grow with uptime.
"""
from __future__ import annotations

GAUGES = (("sessions", "framekv_sessions", "Sessions open."),
          ("max_sessions", "framekv_session_slots", "Sessions allowed open at once."),
          ("slots", "framekv_pool_slots",
           "Sessions the pool holds at once; the others wait swapped out."),
          ("sessions_resident", "framekv_sessions_resident",
           "Open sessions holding a pool slot."),
          ("sessions_swapped", "framekv_sessions_swapped",
           "Open sessions swapped out to host memory."),
          ("swapped_bytes", "framekv_swapped_bytes",
           "Host bytes held by the swapped-out sessions' streams."),
          ("pool_bytes", "framekv_pool_bytes", "Bytes mapped by the K/V pool."))
COUNTERS = (("steps", "framekv_steps", "Batched steps run."),
            ("failed_steps", "framekv_failed_steps", "Batched steps that raised."),
            ("failed_resets", "framekv_failed_resets",
             "Failed steps whose rows could not be started over."),
            ("chunks", "framekv_chunks", "Chunks made, all sessions."),
            ("swap_outs", "framekv_swap_outs", "Sessions swapped out of the pool."),
            ("swap_ins", "framekv_swap_ins", "Sessions swapped back into the pool."),
            ("swap_bytes", "framekv_swap_bytes", "Host bytes moved by swaps, both ways."),
            ("failed_swaps", "framekv_failed_swaps",
             "Swaps that raised; each failed its session."),
            ("graph_replays", "framekv_graph_replays", "Whole-chunk graph replays."),
            ("graph_captures", "framekv_graph_captures", "Graphs captured."),
            ("frames_in", "framekv_input_frames", "Video sessions' input frames received."),
            ("frames_dropped", "framekv_input_frames_dropped",
             "Input frames dropped: newer ones came before a chunk took them."))
HISTOGRAMS = (("step_seconds", "framekv_step_seconds",
               "Seconds of a batched step, its decode included."),
              ("chunk_seconds", "framekv_chunk_seconds",
               "Seconds from a session being ready for a chunk to the chunk queued."),
              ("swap_seconds", "framekv_swap_seconds",
               "Seconds of one swap out or in, its copies waited for."),
              ("input_seconds", "framekv_input_latency_seconds",
               "Seconds from a chunk's newest input frame received to the chunk handed "
               "out to be sent (video sessions)."))


class SchedulerCollector:
    """A prometheus_client collector over ``sched.metrics()`` (module doc); over a
    cluster's sessions (``sched.metrics_by_replica()``) each series has a ``replica``
    label, one sample per replica."""

    def __init__(self, sched):
        self.sched = sched

    def _rows(self) -> tuple[list[str], list[tuple[list[str], dict]]]:
        by_replica = getattr(self.sched, "metrics_by_replica", None)
        if by_replica is None:
            return [], [([], _with_frames_decoded(self.sched.metrics()))]
        return ["replica"], [([rid], _with_frames_decoded(m)) for rid, m in by_replica().items()]

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)

        labels, rows = self._rows()

        def family(kind, name, doc, key):
            f = kind(name, doc, labels=labels)
            for values, m in rows:
                if key in m:
                    f.add_metric(values, m[key])
            return [f] if f.samples else []    # a series only some servers have

        for key, name, doc in GAUGES:
            yield from family(GaugeMetricFamily, name, doc, key)
        yield from family(GaugeMetricFamily, "framekv_gpu_allocated_bytes",
                          "Bytes torch has allocated on the server's GPU.", "gpu_allocated_bytes")
        for key, name, doc in COUNTERS:
            yield from family(CounterMetricFamily, name, doc, key)
        yield from family(CounterMetricFamily, "framekv_video_frames", "Video frames decoded.",
                          "video_frames_decoded")
        ended = CounterMetricFamily("framekv_sessions_ended", "Sessions closed, by reason.",
                                    labels=[*labels, "reason"])
        for values, m in rows:
            for reason, n in sorted(m["ended"].items()):
                ended.add_metric([*values, reason], n)
        yield ended
        for key, name, doc in HISTOGRAMS:
            h = HistogramMetricFamily(name, doc, labels=labels)
            for values, m in rows:
                buckets = [(repr(float(b)), n) for b, n in m[key]["buckets"]]
                h.add_metric(values, buckets + [("+Inf", m[key]["count"])], m[key]["sum"])
            yield h


def _with_frames_decoded(m: dict) -> dict:
    """``m`` with ``video_frames_decoded`` when decoding (a series only such a server
    has; ``gpu_allocated_bytes`` is the scheduler's, on CUDA)."""
    m = dict(m)
    if m["decoding"]:
        m["video_frames_decoded"] = m["video_frames"]
    return m


def metrics_registry(sched):
    """A fresh ``CollectorRegistry`` holding only ``sched``'s collector."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SchedulerCollector(sched))
    return registry


def render(registry, accept: str | None) -> tuple[bytes, str]:
    """(body, content type) of a scrape: OpenMetrics when ``accept`` asks for it,
    else Prometheus text."""
    from prometheus_client.exposition import choose_encoder

    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
