"""The data plane's counters: plain numbers on the hot path (Stats), mergeable across its worker processes
(as JSON), and turned into Prometheus metrics only when scraped (Collector). No I/O."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field, fields

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CLIENT_CLOSED = 499  # nginx's code for a client that went away before the answer: in the metrics only
BACKEND_COUNTS = ("in_flight", "requests", "failures")

COUNTERS = (("holds", "Requests held while no backend could take them"),
            ("hold_timeouts", "Held requests answered 503 after the hold"),
            ("retries", "Attempts sent again after a connection error"),
            ("resends", "Requests sent again after a connection dropped under them (an engine may have had them)"),
            ("broken_streams", "Responses cut after they began (the engine or client went away)"),
            ("malformed", "Requests refused as malformed HTTP"),
            ("refused_connections", "Connections refused above the cap"),
            ("migrations", "Streams continued on another replica after theirs failed or was drained"),
            ("migrations_refused", "Streams that could not be continued elsewhere (cut, or finished where they were)"),
            ("kv_events", "KV-cache events received from the engines (each worker follows every engine)"),
            ("kv_event_gaps", "Breaks in an engine's KV events (batches lost): that replica's exact index began again"),
            ("admission_waits", ("Requests that waited while prompts in flight took the replicas' KV caches "
             "(endpoint/dataplane/admission.py)")),
            ("stream_pauses", ("Streams of a user above their fair share paused for a user below theirs "
             "(continued when a place freed)")))
NAMES = {"malformed": "malformed_requests"}


@dataclass
class Stats:
    codes: dict[int, int] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    duration_sum: float = 0.0
    holds: int = 0
    hold_timeouts: int = 0
    held: int = 0
    retries: int = 0
    resends: int = 0
    broken_streams: int = 0
    malformed: int = 0
    refused_connections: int = 0
    index_blocks: int = 0  # prefix blocks the routing index holds (set when read)
    migrations: int = 0
    migrations_refused: int = 0
    kv_events: int = 0  # set when read, from the feeds (kv_feed)
    kv_event_gaps: int = 0
    kv_feeds_live: int = 0
    admission_waits: int = 0  # set when read, from the admission (admission.py)
    admission_waiting: int = 0
    stream_pauses: int = 0  # set when read, from the admission
    streams_open: int = 0  # set when read: streams under way that may move (streams.py)
    projects: dict[str, list[int]] = field(default_factory=dict)  # with tenants: [requests, prompt, completion]
    # set when read, from the admission: per project, the requests that waited there (wait_histogram)
    admission_wait: dict[str, list[float]] = field(default_factory=dict)

    def done(self, status: int, seconds: float) -> None:
        self.codes[status] = self.codes.get(status, 0) + 1
        self.buckets[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.duration_sum += seconds

    def used(self, project: str | None, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        counts = self.projects.get(project or "-")
        if counts is None:
            counts = self.projects[project or "-"] = [0, 0, 0]
        counts[0] += 1
        counts[1] += prompt_tokens or 0
        counts[2] += completion_tokens or 0

    def to_json(self) -> dict:
        return {**asdict(self), "codes": {str(code): count for code, count in self.codes.items()}}

    @classmethod
    def merged(cls, parts: list[dict]) -> Stats:
        """The sum of several workers' Stats.to_json()."""
        total = cls()
        for part in parts:
            for code, count in part.get("codes", {}).items():
                total.codes[int(code)] = total.codes.get(int(code), 0) + count
            total.buckets = [a + b for a, b in zip(total.buckets, part.get("buckets", []))] or total.buckets
            merge_counts(total.projects, part.get("projects", {}))
            merge_counts(total.admission_wait, part.get("admission_wait", {}))
            for item in fields(cls):
                if item.name not in ("codes", "buckets", "projects", "admission_wait"):
                    setattr(total, item.name, getattr(total, item.name) + part.get(item.name, 0))
        return total


def wait_histogram() -> list[float]:
    """Counts per DURATION_BUCKETS bucket (the last one above them all), then the seconds summed."""
    return [0] * (len(DURATION_BUCKETS) + 1) + [0.0]


def observe(histogram: list[float], seconds: float) -> None:
    histogram[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
    histogram[-1] += seconds


def merge_counts(into: dict, part: dict) -> None:
    """Adds per-project lists of counts (Stats.projects' or wait_histogram's) into `into`, element by element."""
    for project, counts in part.items():
        known = into.get(project)
        into[project] = list(counts) if known is None else [a + b for a, b in zip(known, counts)]


def cumulative_buckets(counts: list) -> list[tuple[str, float]]:
    """Prometheus' cumulative (le, count) pairs of per-bucket counts over DURATION_BUCKETS and +Inf."""
    total, buckets = 0, []
    for bound, count in zip((*DURATION_BUCKETS, float("inf")), counts):
        total += count
        buckets.append((str(bound) if bound != float("inf") else "+Inf", total))
    return buckets


def merged_backends(parts: list[list[dict]]) -> list[dict]:
    """Per-backend rows of several workers ({url, in_flight, requests, failures, ...}) summed by URL, in
    the first worker's order; other keys are taken from the first row seen, `failed` from any."""
    rows: dict[str, dict] = {}
    for part in parts:
        for row in part:
            known = rows.get(row["url"])
            if known is None:
                rows[row["url"]] = dict(row)
                continue
            for name in BACKEND_COUNTS:
                known[name] = known.get(name, 0) + row.get(name, 0)
            if "failed" in row:
                known["failed"] = known.get("failed", False) or row["failed"]
    return list(rows.values())


class Collector:
    """Prometheus metrics from Stats and per-backend rows (one worker's, or all workers' merged)."""

    def __init__(self, stats: Stats, backends: list[dict], workers: int = 1):
        self.stats, self.backends, self.workers = stats, backends, workers

    def collect(self):
        stats = self.stats
        codes = CounterMetricFamily("hpcserve_router_requests", "Requests answered, by HTTP status "
                                    f"({CLIENT_CLOSED}: the client left, or the stream broke)", labels=["code"])
        for code, count in sorted(stats.codes.items()):
            codes.add_metric([str(code)], count)
        yield codes
        yield HistogramMetricFamily("hpcserve_router_request_duration_seconds", "From the request's arrival to "
                                    "the end of its response", buckets=cumulative_buckets(stats.buckets),
                                    sum_value=stats.duration_sum)
        for name, doc in COUNTERS:
            yield CounterMetricFamily(f"hpcserve_router_{NAMES.get(name, name)}", doc, value=getattr(stats, name))
        yield GaugeMetricFamily("hpcserve_router_held", "Requests held now", value=stats.held)
        yield GaugeMetricFamily("hpcserve_router_admission_waiting", "Requests waiting now in admission: for "
                                "room in the replicas' KV caches, or a place (fair share)",
                                value=stats.admission_waiting)
        yield GaugeMetricFamily("hpcserve_router_streams_open", "Streams under way that may continue on another "
                                "replica (their first chunk passed on)", value=stats.streams_open)
        yield GaugeMetricFamily("hpcserve_router_prefix_index_blocks", "Prompt blocks the routing index holds "
                                "(summed over workers: each keeps its own copy)", value=stats.index_blocks)
        yield GaugeMetricFamily("hpcserve_router_kv_feeds_live", "Engines whose KV events are followed now "
                                "(summed over workers)", value=stats.kv_feeds_live)
        yield GaugeMetricFamily("hpcserve_router_workers", "Worker processes serving the client port",
                                value=self.workers)
        in_flight = GaugeMetricFamily("hpcserve_router_backend_in_flight", "Requests in flight to each backend "
                                      "through the data plane", labels=["backend"])
        sent = CounterMetricFamily("hpcserve_router_backend_requests", "Requests sent to each backend",
                                   labels=["backend"])
        failures = CounterMetricFamily("hpcserve_router_backend_failures", "Connection errors of each backend",
                                       labels=["backend"])
        for row in self.backends:
            in_flight.add_metric([row["url"]], row.get("in_flight", 0))
            sent.add_metric([row["url"]], row.get("requests", 0))
            failures.add_metric([row["url"]], row.get("failures", 0))
        yield from (in_flight, sent, failures)
        if stats.projects:
            requests = CounterMetricFamily("hpcserve_project_requests", "Requests answered, by the project of their "
                                           "key (tenancy; '-': none)", labels=["project"])
            tokens = CounterMetricFamily("hpcserve_project_tokens", "Tokens of the answered requests, by project and "
                                         "kind (prompt, completion)", labels=["project", "kind"])
            for project, (count, prompt, completion) in sorted(stats.projects.items()):
                requests.add_metric([project], count)
                tokens.add_metric([project, "prompt"], prompt)
                tokens.add_metric([project, "completion"], completion)
            yield from (requests, tokens)
        if stats.admission_wait:
            waits = HistogramMetricFamily("hpcserve_project_admission_wait_seconds", "How long requests waited in "
                                          "the data plane's admission for a place (fair share) or for room in the "
                                          "KV caches, by project ('-': none); only those that waited: "
                                          "hpcserve_project_requests counts all", labels=["project"])
            for project, histogram in sorted(stats.admission_wait.items()):
                waits.add_metric([project], cumulative_buckets(histogram[:-1]), histogram[-1])
            yield waits
