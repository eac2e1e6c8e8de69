"""The Prometheus metrics rtrl exports: one catalogue, so alerts and dashboards can be
checked against the names services really register (see tests/unit/test_metric_names.py).

Each service imports the metrics it updates from here. Add new metrics here, in the
section of the service that owns them, and list them in ``OWNERS``: a process serves
``registry_for(its service)``, so it exports only its own metrics (and the shared ones),
never another service's gauges at their initial 0 (which made alerts such as
RtrlTrainingOverdue fire on every process).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    multiprocess,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

BUILD_INFO = Info("rtrl_build", "rtrl version and the service this process runs")

# --- shared by every Kafka consumer -------------------------------------------------------
CONSUMER_LAG = Gauge(
    "rtrl_consumer_lag_messages",
    "Messages between the committed/consumed position and the end of the partition",
    ["rtrl_service", "topic", "partition"],
)
BATCH_SECONDS = Histogram(
    "rtrl_batch_processing_seconds", "Time to process one polled batch", ["rtrl_service"],
    buckets=LATENCY_BUCKETS,
)

DEPENDENCY_RETRIES = Counter(
    "rtrl_dependency_retries_total",
    "Failed calls to a dependency (Kafka, Redis, MLflow) that the service retries by itself",
    ["rtrl_service", "dependency"],
)
"""Rising steadily: the dependency is down or flapping; the service keeps retrying with backoff."""

# --- ingest ------------------------------------------------------------------------------
INGEST_EVENTS = Counter("rtrl_ingest_events_total", "Raw events read by ingest", ["result"])
"""result: valid | rejected | duplicate"""
INGEST_REJECTED = Counter(
    "rtrl_ingest_rejected_total", "Raw events sent to the dead-letter topic, by reason", ["reason"]
)

# --- reward ------------------------------------------------------------------------------
REWARD_EVENTS = Counter("rtrl_reward_events_total", "Events consumed by the reward join", ["type"])
REWARD_LATE = Counter(
    "rtrl_reward_late_events_total",
    "Events that arrived after their request's reward was emitted (counted, not re-emitted)",
    ["type"],
)
REWARD_ORPHANS = Counter(
    "rtrl_reward_orphan_events_total",
    "Feedback events whose completion.served never arrived before their window expired",
)
REWARD_OPEN_WINDOWS = Gauge("rtrl_reward_open_windows", "Reward windows waiting to close")
REWARD_OLDEST_OPEN_AGE = Gauge(
    "rtrl_reward_oldest_open_window_overdue_seconds",
    "How far past its due time the most overdue open window is (0 when none is overdue)",
)
REWARDS_EMITTED = Counter("rtrl_rewards_emitted_total", "Reward records emitted", ["arm", "defaulted"])
REWARD_VALUE = Histogram(
    "rtrl_reward_value", "Emitted reward values", ["arm"],
    buckets=(-2, -1, -0.5, -0.25, 0, 0.25, 0.5, 1, 2),
)
REWARD_VALUE_POSITIVE = Counter(
    "rtrl_reward_value_positive", "Sum of the emitted reward values above 0", ["arm"]
)
REWARD_VALUE_NEGATIVE = Counter(
    "rtrl_reward_value_negative", "Sum of the magnitudes of the emitted reward values below 0", ["arm"]
)
"""A histogram with buckets below 0 exports no ``_sum``; the mean reward of an arm is
(rate(positive) - rate(negative)) / rate(rtrl_reward_value_count)."""
REWARD_CLOSE_SECONDS = Histogram(
    "rtrl_reward_close_latency_seconds",
    "From the closing event (or due time) to the reward record being committed",
    buckets=LATENCY_BUCKETS,
)
REWARD_RECOVERED = Counter(
    "rtrl_reward_recovered_total",
    "Request ids found on the rewards topic at partition assignment and marked emitted "
    "(non-zero after a worker died between its Kafka commit and its Redis update)",
)
REWARD_SESSIONS_CLOSED = Counter(
    "rtrl_reward_sessions_closed_total",
    "Agent sessions credited by the session stage, by how they closed", ["status"],
)
REWARD_SESSION_TURNS = Counter(
    "rtrl_reward_session_records_total",
    "Reward records the session stage emitted (credited turns and set-aside requests)",
)
REWARD_OPEN_SESSIONS = Gauge(
    "rtrl_reward_open_sessions", "Agent sessions the session stage holds open on this worker's partitions"
)

# --- trainer -----------------------------------------------------------------------------
TRAIN_INCREMENTS = Counter(
    "rtrl_trainer_increments_total", "RL increments by outcome", ["outcome"]
)
"""outcome: success | failed | skipped"""
TRAIN_RUNNING = Gauge("rtrl_trainer_increment_running", "1 while an increment runs")
TRAIN_LAST_SUCCESS = Gauge(
    "rtrl_trainer_last_success_timestamp_seconds", "Unix time of the last registered candidate"
)
TRAIN_CADENCE = Gauge("rtrl_trainer_cadence_seconds", "Configured time between increments")
TRAIN_DURATION = Histogram(
    "rtrl_trainer_increment_seconds", "Wall time of an increment, trigger to registered",
    buckets=(10, 30, 60, 120, 300, 600, 1800, 3600, 7200),
)
TRAIN_STAT = Gauge(
    "rtrl_trainer_last_increment_stat",
    "Statistics of the last increment (loss, kl, clip_fraction, ess, reward_mean, ...)",
    ["stat"],
)
GATE_RESULTS = Counter("rtrl_gate_results_total", "Offline gate results", ["result"])
TRAIN_STARTS = Counter(
    "rtrl_trainer_increment_starts_total", "Increments started by the service, by trigger", ["trigger"]
)
"""trigger: interval (the interval passed) | records (enough records and users arrived early)"""
TRAIN_WAITING = Gauge(
    "rtrl_trainer_waiting", "1 while the next increment waits, by what it waits for", ["waiting_for"]
)
"""waiting_for: canary (a due increment waits for the canary in flight to be decided) | records"""
TRAIN_PENDING_RECORDS = Gauge(
    "rtrl_trainer_pending_records", "Reward records after the last cut the next increment would train on"
)
TRAIN_PENDING_ESS = Gauge(
    "rtrl_trainer_pending_ess", "Effective sample size over users of rtrl_trainer_pending_records"
)

# --- deployer / judge --------------------------------------------------------------------
CANARY_PHASE = Gauge("rtrl_canary_phase", "1 for the canary's current phase", ["phase"])
CANARY_WEIGHT = Gauge("rtrl_canary_weight", "Share of users routed to the canary (0..1)")
CANARY_PHASE_AGE = Gauge(
    "rtrl_canary_phase_age_seconds", "Seconds since the canary entered its current phase"
)
CANARY_VERDICTS = Counter("rtrl_canary_verdicts_total", "Judge verdicts per tick", ["verdict"])
CANARY_PROMOTIONS = Counter("rtrl_canary_promotions_total", "Candidates promoted", ["decided_by"])
CANARY_ROLLBACKS = Counter(
    "rtrl_canary_rollbacks_total", "Canaries rolled back", ["reason", "decided_by"]
)
CANARY_ABORTS = Counter("rtrl_canary_aborts_total", "Canaries aborted (inconclusive, errors)", ["reason"])
JUDGE_STAT = Gauge(
    "rtrl_judge_statistic", "The judge's latest statistics per metric", ["metric", "stat"]
)
CANARY_PLAN = Gauge(
    "rtrl_canary_plan",
    "The canary's plan per primary metric (stat: users, needed = canary users at which it is "
    "decided with 80% power if no worse, eta_seconds; -1 when unknown)", ["metric", "stat"],
)
CANARY_DECISION_ETA = Gauge(
    "rtrl_canary_decision_eta_seconds",
    "Seconds until every primary metric has its planned users at the traffic so far (-1: unknown)",
)
CANARY_BUDGET_USERS = Gauge(
    "rtrl_canary_budget_users",
    "The canary's budget in canary users (deployer budget_factor x its plan's largest need; 0: not planned)",
)
HOLDOUT_EFFECT = Gauge(
    "rtrl_holdout_effect",
    "The champion minus the long-term holdout per metric, with its always-valid interval "
    "(stat: estimate, lower, upper, relative)", ["metric", "stat"],
)
HOLDOUT_USERS = Gauge("rtrl_holdout_users", "Users in the champion vs holdout comparison", ["arm"])
HOLDOUT_ACTIVE = Gauge("rtrl_holdout_active", "1 while a long-term holdout is pinned (0: none)")
HACKING_DETECTIONS = Counter(
    "rtrl_reward_hacking_detections_total", "Reward-hacking detectors that fired", ["detector"]
)
OPERATOR_COMMANDS = Counter(
    "rtrl_operator_commands_total", "Manual operator commands the deployer verified", ["command", "result"]
)
"""result: accepted | unauthenticated (unsigned, allowed by operators.allow_unauthenticated) |
refused as unknown_command, unsigned, no_keys, unknown_operator, bad_signature, expired or
replayed."""
GROUP_LAG_MESSAGES = Gauge(
    "rtrl_group_lag_messages",
    "Records between a pipeline consumer group's committed offsets and the partitions' ends, "
    "read from the broker (deployer/adapters/group_lag.py)",
    ["group", "topic"],
)
GROUP_LAG_SECONDS = Gauge(
    "rtrl_group_lag_seconds",
    "How long the oldest record the group has not committed has waited (0 with no backlog)",
    ["group", "topic"],
)
NOTIFICATIONS = Counter(
    "rtrl_notifications_total", "Decision notifications, one per decision and webhook URL", ["result"]
)
"""result: sent (a 2xx answered) | failed (no 2xx after the retries, or a final 4xx) |
dropped (the delivery queue was full: never sent)"""
GROUP_LAG_READ = Gauge(
    "rtrl_group_lag_read_timestamp_seconds", "Unix time of the last successful group-lag read"
)

# --- gateway -----------------------------------------------------------------------------
GATEWAY_REQUESTS = Counter(
    "rtrl_gateway_requests_total", "Gateway requests", ["arm", "version", "code"]
)
GATEWAY_ERRORS = Counter(
    "rtrl_gateway_errors_total", "Gateway errors by arm and kind", ["arm", "version", "kind"]
)
GATEWAY_SECONDS = Histogram(
    "rtrl_gateway_request_seconds", "Gateway request latency", ["arm"], buckets=LATENCY_BUCKETS
)
GATEWAY_FALLBACKS = Counter(
    "rtrl_gateway_canary_fallbacks_total", "Canary requests served by stable because the canary failed"
)
GATEWAY_EXPOSURES = Counter(
    "rtrl_gateway_exposures_total", "Events the gateway logged (completion.served, and a named session's "
    "session.turn and tool.call) by outcome", ["result"]
)
"""result: sent (acked by the broker) | failed (broker refused or timed out) |
dropped (queue full or broker unreachable: never sent) | invalid (did not fit the contract)"""
GATEWAY_MODEL_LOADS = Counter(
    "rtrl_gateway_model_loads_total", "Model version loads by arm and result", ["arm", "result"]
)
# gauges say how several gateway workers combine (prometheus-client multiprocess mode, used
# by ``rtrl serve gateway``; ignored in a single process): over live workers only
GATEWAY_SERVING = Gauge(
    "rtrl_gateway_serving_version", "1 for the version each arm currently serves", ["arm", "version"],
    multiprocess_mode="livemax",
)
GATEWAY_ROUTING_AGE = Gauge(
    "rtrl_gateway_routing_age_seconds", "Seconds since the routing table was last read from Redis",
    multiprocess_mode="livemax",
)
GATEWAY_CONNECTIONS = Counter(
    "rtrl_gateway_connections_closed_total",
    "Connections the gateway's HTTP server refused or cut off, by reason", ["reason"],
)
"""reason (services/gateway/asgi/protocol.py): overloaded (max_connections all busy: 503) |
per_client (max_connections_per_client from one address: 429) | evicted (the longest-waiting
idle or silent connection, closed to make room) | header_timeout (headers not in within
header_timeout_s: closed, or 408 when some arrived) | idle_timeout (keep-alive, no request for
idle_timeout_s) | malformed (400 from the parser) | headers_too_large | request_line_too_long |
http_version"""
GATEWAY_CLIENT_REQUESTS = Counter(
    "rtrl_gateway_client_requests_total", "API requests by client key id", ["key_id"]
)
"""key_id: the id of the API key that authenticated the request (never the key itself),
``anonymous`` when anonymous access is allowed, ``rejected`` for 401s."""
GATEWAY_OPEN_CONNECTIONS = Gauge(
    "rtrl_gateway_open_connections", "Client connections the gateway's HTTP server holds open",
    multiprocess_mode="livesum",
)
GATEWAY_SPOOL_BYTES = Gauge(
    "rtrl_gateway_spool_bytes", "Served events on disk waiting for the broker (bytes)",
    multiprocess_mode="livemax",
)
GATEWAY_SPOOL_AGE = Gauge(
    "rtrl_gateway_spool_oldest_seconds", "Age of the oldest served event waiting in the spool (0: none)",
    multiprocess_mode="livemax",
)
GATEWAY_WORKER_RESTARTS = Counter(
    "rtrl_gateway_worker_restarts_total", "Gateway worker processes started in place of one that died"
)

# --- simulator ---------------------------------------------------------------------------
SIM_REQUESTS = Counter(
    "rtrl_sim_requests_total", "Requests the simulated users sent to the gateway", ["arm", "code"]
)
SIM_EVENTS = Counter("rtrl_sim_events_total", "Client events sent by the simulated users", ["type"])
SIM_SCHEDULED = Gauge("rtrl_sim_scheduled_events", "Client events waiting for their due time")


SHARED: tuple[Collector, ...] = (BUILD_INFO, CONSUMER_LAG, BATCH_SECONDS, DEPENDENCY_RETRIES)
"""Exported by every service."""
OWNERS: dict[str, tuple[Collector, ...]] = {
    "ingest": (INGEST_EVENTS, INGEST_REJECTED),
    "reward": (REWARD_EVENTS, REWARD_LATE, REWARD_ORPHANS, REWARD_OPEN_WINDOWS, REWARD_OLDEST_OPEN_AGE,
               REWARDS_EMITTED, REWARD_VALUE, REWARD_VALUE_POSITIVE, REWARD_VALUE_NEGATIVE,
               REWARD_CLOSE_SECONDS, REWARD_RECOVERED, REWARD_SESSIONS_CLOSED, REWARD_SESSION_TURNS,
               REWARD_OPEN_SESSIONS),
    "trainer": (TRAIN_INCREMENTS, TRAIN_RUNNING, TRAIN_LAST_SUCCESS, TRAIN_CADENCE, TRAIN_DURATION,
                TRAIN_STAT, GATE_RESULTS, TRAIN_STARTS, TRAIN_WAITING, TRAIN_PENDING_RECORDS,
                TRAIN_PENDING_ESS),
    "deployer": (CANARY_PHASE, CANARY_WEIGHT, CANARY_PHASE_AGE, CANARY_VERDICTS, CANARY_PROMOTIONS,
                 CANARY_ROLLBACKS, CANARY_ABORTS, JUDGE_STAT, CANARY_PLAN, CANARY_DECISION_ETA,
                 CANARY_BUDGET_USERS, HACKING_DETECTIONS, GROUP_LAG_MESSAGES,
                 GROUP_LAG_SECONDS, GROUP_LAG_READ, OPERATOR_COMMANDS, NOTIFICATIONS, HOLDOUT_EFFECT,
                 HOLDOUT_USERS, HOLDOUT_ACTIVE),
    "gateway": (GATEWAY_REQUESTS, GATEWAY_ERRORS, GATEWAY_SECONDS, GATEWAY_FALLBACKS, GATEWAY_EXPOSURES,
                GATEWAY_MODEL_LOADS, GATEWAY_SERVING, GATEWAY_ROUTING_AGE, GATEWAY_CONNECTIONS,
                GATEWAY_CLIENT_REQUESTS, GATEWAY_OPEN_CONNECTIONS, GATEWAY_SPOOL_BYTES, GATEWAY_SPOOL_AGE,
                GATEWAY_WORKER_RESTARTS),
    "simulator": (SIM_REQUESTS, SIM_EVENTS, SIM_SCHEDULED),
}
"""The metrics each service updates, and so exports."""


def registry_for(*services: str) -> CollectorRegistry:
    """A registry holding the process, platform and GC collectors, the shared metrics and
    the given services' own: what that process's ``/metrics`` serves. The metric objects
    are the catalogue's, so updates through the module's names show up in it."""
    unknown = sorted(set(services) - set(OWNERS))
    if unknown:
        raise ValueError(f"unknown service(s) {unknown}; known: {sorted(OWNERS)}")
    registry = CollectorRegistry(auto_describe=True)
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR, *SHARED):
        registry.register(collector)
    for service in dict.fromkeys(services):
        for collector in OWNERS[service]:
            registry.register(collector)
    return registry


def multiprocess_registry(service: str) -> CollectorRegistry:
    """What ``/metrics`` serves when several processes of ``service`` share one port
    (``PROMETHEUS_MULTIPROC_DIR`` set before they started): every process's values of the
    service's own and the shared metrics, combined (counters and histograms summed, gauges
    as their ``multiprocess_mode`` says), and this process's build info. Per-process
    collectors (process_*, python_gc_*) are left out: a scrape reaches one worker at random."""
    families = [metric for collector in (*SHARED, *OWNERS[service]) if collector is not BUILD_INFO
                for metric in collector.describe()]  # type: ignore[attr-defined]
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Only(multiprocess.MultiProcessCollector(None), families))  # type: ignore[no-untyped-call]
    registry.register(BUILD_INFO)
    return registry


class _Only(Collector):
    """The metric families of ``inner`` named in ``families`` (every rtrl process imports the
    whole catalogue, so each one's files hold other services' metrics at their initial 0),
    and the rest of ``families`` without samples, as one process exports a labelled metric
    nobody has set yet: its HELP and TYPE, which Prometheus's metadata lists."""

    def __init__(self, inner: Collector, families: list[Metric]) -> None:
        self._inner = inner
        self._families = {f.name: f for f in families}

    def collect(self) -> Iterable[Metric]:
        got = [m for m in self._inner.collect() if m.name in self._families]
        seen = {m.name for m in got}
        return got + [f for name, f in self._families.items() if name not in seen]


def observe_reward(arm: str, value: float) -> None:
    """Record one emitted reward: its bucket, and its sign's running sum."""
    REWARD_VALUE.labels(arm).observe(value)
    if value > 0:
        REWARD_VALUE_POSITIVE.labels(arm).inc(value)
    elif value < 0:
        REWARD_VALUE_NEGATIVE.labels(arm).inc(-value)
