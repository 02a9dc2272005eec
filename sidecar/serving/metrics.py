"""The sidecar's Prometheus metrics and the progress it sends its world's coordinator.

Two kinds of series:

- what the trainer counts (rows, batches, data-ready latency, time waiting for
  data) is read at scrape time from each rank's control block (ring.py's
  `progress` words, written by `StreamClient`): a custom collector mirrors
  those cumulative counts, the pattern prometheus_client documents for
  counters kept elsewhere, so the trainer pays no message and no lock;
- what the sidecar itself times (a read, a checkpoint) goes into ordinary
  prometheus_client histograms through thin wrappers (`timed_batches`,
  `timed_checkpoint`).

`ProgressReporter` runs on the serving loop (its `tick`) and sends the same
counts to the coordinator every PROGRESS_EVERY_S, which is how the operator
learns a running world's progress without reading any data
(docs/observability.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from splitfeed.trainer_client.contract import wellknown, messages, progress, stalls
from splitfeed.trainer_client.transport import ring

from ..world import agreement

log = logging.getLogger(__name__)

METRICS_PORT_ENV = wellknown.METRICS_PORT_ENV
DEFAULT_METRICS_PORT = wellknown.METRICS_PORT
"""The sidecar's /metrics port in a pod (docs/pod-contract.md); 0 turns the endpoint off."""
PROGRESS_EVERY_S = 2.0
"""How often a member tells the coordinator its ranks' progress (less often in a world of over
32 members: PROGRESS_PER_S)."""
PROGRESS_PER_S = 16.0
"""At most this many `progress` reports a second reach the coordinator from all its members
together (agreement.at_rest_period_s): 64 s between two of a member's in a world of 1,024, so
that the coordinator at rest stays under 1% of a core there (tests/bench/coordinator.py: 1.02-1.18%
at 32 a second). It paces status.progress only: a new world's first batch is said at once."""
READ_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CHECKPOINT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LABELS = ("job", "namespace", "world", "replica")
"""Every series' labels; per-rank series add `rank`. `world` is the world epoch."""

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Labels:
    job: str
    namespace: str
    world: int
    replica: int

    def values(self) -> list[str]:
        return [self.job, self.namespace, str(self.world), str(self.replica)]


@dataclasses.dataclass(frozen=True)
class RankProgress:
    """One rank's cumulative counts, as the trainer left them in its control block."""

    rank: int
    global_step: int
    counts: list[int]
    wait_s: float
    wall_s: float
    rows: int
    batches: int
    bytes: int
    filled: int
    slots: int


def read_rank(feed: Any) -> RankProgress:
    """A serving.Feed's progress (its control block, rank, and its publisher's bytes)."""
    control: ring.Control = feed.control
    counts, words = control.read_progress()
    return RankProgress(rank=feed.rank, global_step=control.steps_done(), counts=counts,
                        wait_s=words["wait_ns"] / 1e9, wall_s=words["wall_ns"] / 1e9,
                        rows=words["rows"], batches=words["batches"],
                        bytes=int(feed.publisher.bytes_published),
                        filled=control.filled(), slots=control.num_slots)


def histogram_buckets(counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts -> Prometheus' cumulative (le, count) pairs, ending with +Inf."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, count in zip((*stalls.BUCKETS_S, float("inf")), counts):
        total += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
    return out


class RingCollector(Collector):
    """Series read from the control blocks at scrape time (see the module doc)."""

    def __init__(self, feeds: Callable[[], Iterable[Any]], labels: Labels) -> None:
        self._feeds = feeds
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        names = [*LABELS, "rank"]
        rows = CounterMetricFamily("splitfeed_rows_delivered", "Rows the trainer received.", labels=names)
        batches = CounterMetricFamily("splitfeed_batches_delivered", "Batches the trainer received.",
                                      labels=names)
        nbytes = CounterMetricFamily("splitfeed_bytes_delivered",
                                     "Bytes of Arrow IPC batches written into the rank's ring.", labels=names)
        waited = CounterMetricFamily("splitfeed_data_wait_seconds",
                                     "Time the trainer waited for data (the first batch excluded).",
                                     labels=names)
        wall = CounterMetricFamily("splitfeed_trainer_seconds",
                                   "Wall time since the trainer's first batch: rate(data_wait)/rate(this) "
                                   "is the stall share.", labels=names)
        ready = HistogramMetricFamily("splitfeed_data_ready_seconds",
                                      "How long the trainer waited for each batch.", labels=names)
        filled = GaugeMetricFamily("splitfeed_ring_filled_batches",
                                   "Batches published into the ring and not yet taken by the trainer.",
                                   labels=names)
        slots = GaugeMetricFamily("splitfeed_ring_slots", "Slots in the rank's ring.", labels=names)
        step = GaugeMetricFamily("splitfeed_global_step", "The next global step the trainer takes.",
                                 labels=names)
        for feed in self._feeds():
            try:
                p = read_rank(feed)
            except (ValueError, AttributeError):
                continue  # closed meanwhile
            values = [*self._labels.values(), str(p.rank)]
            rows.add_metric(values, p.rows)
            batches.add_metric(values, p.batches)
            nbytes.add_metric(values, p.bytes)
            waited.add_metric(values, p.wait_s)
            wall.add_metric(values, p.wall_s)
            ready.add_metric(values, histogram_buckets(p.counts), p.wait_s)
            filled.add_metric(values, p.filled)
            slots.add_metric(values, p.slots)
            step.add_metric(values, p.global_step)
        yield from (rows, batches, nbytes, waited, wall, ready, filled, slots, step)


class _Current(Collector):
    """What the /metrics endpoint serves: the current world's registry. By hand because
    prometheus_client binds an HTTP server to one registry for its life, and a sidecar
    whose world changes in place keeps its port while its series change."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        return iter(self.registry.collect())


class RejectedCollector(Collector):
    """splitfeed_coordinator_rejected_total: peers the world's coordinator turned away (no CURVE,
    or not the job's key; wire.CoordinatorThread counts them). Replica 0's sidecar only."""

    def __init__(self, rejected: Callable[[], int | None], labels: Labels) -> None:
        self._rejected = rejected
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        count = self._rejected()
        if count is None:
            return
        family = CounterMetricFamily(
            "splitfeed_coordinator_rejected",
            "Connections the world's coordinator rejected: the peer did not hold the job's CURVE key.",
            labels=LABELS)
        family.add_metric(self._labels.values(), count)
        yield family


TrafficCounts = tuple[dict[tuple[str, str], int], dict[str, int]]
"""wire.Traffic.snapshot(): messages by (direction, type), payload bytes by direction."""


class TrafficCollector(Collector):
    """splitfeed_coordinator_messages_total{direction, type} and
    splitfeed_coordinator_message_bytes_total{direction}: the control plane's load on replica 0's
    sidecar (wire.Traffic), which grows with the world's members. Replica 0's sidecar only."""

    def __init__(self, traffic: Callable[[], TrafficCounts | None], labels: Labels) -> None:
        self._traffic = traffic
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        counts = self._traffic()
        if counts is None:
            return
        messages_by, bytes_by = counts
        found = CounterMetricFamily("splitfeed_coordinator_messages",
                                    "Messages through the world's coordinator's socket.",
                                    labels=[*LABELS, "direction", "type"])
        for (direction, kind), count in sorted(messages_by.items()):
            found.add_metric([*self._labels.values(), direction, kind], count)
        size = CounterMetricFamily("splitfeed_coordinator_message_bytes",
                                   "Payload bytes of the messages through the world's coordinator's socket.",
                                   labels=[*LABELS, "direction"])
        for direction, count in sorted(bytes_by.items()):
            size.add_metric([*self._labels.values(), direction], count)
        yield found
        yield size


class SidecarMetrics:
    """One sidecar's registry: the ring collector plus what the sidecar times itself."""

    def __init__(self, labels: Labels, feeds: Callable[[], Iterable[Any]] = list,
                 rejected: Callable[[], int | None] = lambda: None,
                 traffic: Callable[[], TrafficCounts | None] = lambda: None) -> None:
        self.labels = labels
        self.feeds = feeds
        """The serving RankFeeds (set once the server exists)."""
        self.port: int | None = None
        """The port /metrics is served on, once `serve` bound one."""
        self.registry = CollectorRegistry()
        self.registry.register(RingCollector(lambda: self.feeds(), labels))
        self.registry.register(RejectedCollector(rejected, labels))
        self.registry.register(TrafficCollector(traffic, labels))
        self._current = _Current(self.registry)
        self.read_seconds = Histogram(
            "splitfeed_read_seconds", "Time the reader took to produce one batch (table reads and ordering).",
            LABELS, buckets=READ_BUCKETS_S, registry=self.registry).labels(*labels.values())
        self.checkpoint_seconds = Histogram(
            "splitfeed_checkpoint_seconds", "Time to write one rank's checkpoint record.",
            LABELS, buckets=CHECKPOINT_BUCKETS_S, registry=self.registry).labels(*labels.values())
        self.checkpoint_failures = Counter(
            "splitfeed_checkpoint_failures", "Checkpoint writes that failed.", LABELS,
            registry=self.registry).labels(*labels.values())

    def serve(self, port: int, addr: str = "") -> int | None:
        """Serve /metrics on `port` (0: pick one); the port bound, or None if it cannot bind.

        A taken port is a warning, never a failure: metrics must not stop a world. The
        endpoint serves whichever world's registry is current (`take_over`).
        """
        served = CollectorRegistry()
        served.register(self._current)
        try:
            server, _thread = start_http_server(port, addr=addr or wellknown.ALL_INTERFACES, registry=served)
        except OSError as exc:
            log.warning("cannot serve /metrics on port %s: %s (metrics are off for this sidecar)", port, exc)
            return None
        bound = int(server.server_address[1])
        log.info("serving /metrics on port %d", bound)
        return bound

    def take_over(self, previous: SidecarMetrics) -> None:
        """Serve this world's series on the endpoint `previous` (the world before, changed in
        place) opened: one port per process, and the new `world` label from now on."""
        self._current, self.port = previous._current, previous.port
        self._current.registry = self.registry

    def timed_batches(self, batches: Iterator[T]) -> Iterator[T]:
        """`batches`, observing the time each one took to produce into splitfeed_read_seconds."""
        histogram = self.read_seconds
        try:
            while True:
                started = time.perf_counter()
                try:
                    item = next(batches)
                except StopIteration:
                    return
                histogram.observe(time.perf_counter() - started)
                yield item
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def timed_checkpoint(self, write: Callable[[int, int], T]) -> Callable[[int, int], T]:
        """`write`, timed; a failure is counted and raised on."""
        def timed(rank: int, step: int) -> T:
            started = time.perf_counter()
            try:
                out = write(rank, step)
            except BaseException:
                self.checkpoint_failures.inc()
                raise
            self.checkpoint_seconds.observe(time.perf_counter() - started)
            return out
        return timed


def metrics_port(env: Mapping[str, str], default: int = DEFAULT_METRICS_PORT) -> int:
    """SPLITFEED_METRICS_PORT, or `default`; a bad value is a warning and the endpoint is off."""
    raw = env.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return default
    if raw.isdigit() and int(raw) < 65536:
        return int(raw)
    log.warning("%s=%r is not a port number (0-65535); /metrics is off", METRICS_PORT_ENV, raw)
    return 0


def progress_fields(ranks: list[RankProgress], replica: int, steps_per_epoch: int,
                    row_counts: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The `progress` message a member sends its coordinator: its ranks' counts, summed,
    and its loaders' per-row counts (progress.ROW_COUNTS, 0 where not given)."""
    return {
        **{k: int((row_counts or {}).get(k, 0)) for k in progress.ROW_COUNTS},
        "replica": replica,
        "global_step": min((p.global_step for p in ranks), default=0),
        "steps_per_epoch": steps_per_epoch,
        "rows": sum(p.rows for p in ranks),
        "rows_per_s": sum(p.rows / p.wall_s for p in ranks if p.wall_s > 0),
        "wait_s": sum(p.wait_s for p in ranks),
        "wall_s": sum(p.wall_s for p in ranks),
        "buckets": stalls.merge([p.counts for p in ranks]),
    }


class ProgressReporter:
    """A serving-loop tick: every PROGRESS_EVERY_S, send `progress` to the coordinator."""

    def __init__(self, server: Any, steps_per_epoch: int, every_s: float = PROGRESS_EVERY_S,
                 row_counts: Callable[[], Mapping[str, int]] | None = None) -> None:
        self._server = server
        self._steps_per_epoch = steps_per_epoch
        self._row_counts = row_counts or dict
        self._every_s = every_s
        self._next = 0.0
        self._first_batch_at: float | None = None

    def __call__(self) -> None:
        now = time.monotonic()
        member = self._server.member
        if member is None:
            return
        if self._first_batch_at is None and self._first_batch_taken():
            # Said at once, not at the next report: a rescale's latency ends here (operator/cluster/live.py).
            self._first_batch_at, self._next = time.time(), 0.0
        if now < self._next:
            return
        self._next = now + agreement.at_rest_period_s(self._every_s, member.replicas, PROGRESS_PER_S)
        try:
            ranks = [read_rank(feed) for feed in self._server.feeds]
            member.send(messages.Progress(**progress_fields(ranks, member.replica, self._steps_per_epoch,
                                                            self._row_counts()),
                                          first_batch_at=self._first_batch_at))
        except (ValueError, AttributeError):
            return  # a control block closed meanwhile
        except Exception:  # a bug here must never stop the world: report it and stop reporting
            log.exception("progress reporting failed; the world's live status stops here")
            self._every_s = float("inf")

    def _first_batch_taken(self) -> bool:
        """Every rank's trainer has received the world's first batch (its resume step)."""
        try:
            feeds = list(self._server.feeds)
            return bool(feeds) and all(f.control.acked >= self._server.resume_step for f in feeds)
        except (ValueError, AttributeError):
            return False  # a control block closed meanwhile


def local_port(env: Mapping[str, str], replica: int) -> str:
    """`splitfeed local`'s SPLITFEED_METRICS_PORT for a replica's sidecar: the caller's
    port plus the replica (they share one host), or "0" (off) when the caller set none."""
    raw = env.get(METRICS_PORT_ENV, "").strip()
    return str(int(raw) + replica) if raw.isdigit() and int(raw) > 0 else "0"
