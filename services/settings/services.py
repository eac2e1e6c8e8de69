"""Per-service settings: one frozen section per long-running process or command (ingest,
reward, trainer and its gate, gateway and its upstreams); the deployer's is in
services/settings/deployer.py, the simulated users and the demo are in services/settings/demo.py.

``Settings`` in services/settings/model.py composes them with the infrastructure sections
(Kafka, topics, Redis, MLflow, Ray, auth, HTTP, the embedded stack) and reads the
environment (``RTRL_<SECTION>__<FIELD>``); nothing here reads it. Each field's docstring is
its documentation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class Section(BaseModel):
    """The base of every settings section (here and in settings.py): frozen, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class IngestSettings(Section):
    """The ingest service: validation limits, dedup, batching and transactions."""

    max_bytes: int = 256 * 1024
    """Largest accepted record value in bytes; larger ones go to the DLQ as ``oversized``
    before any parsing."""
    max_future_skew_s: float = 300.0
    """An event whose ``ts`` is more than this ahead of the ingest clock is ``ts_future``."""
    max_age_s: float = 7 * 86_400.0
    """An event whose ``ts`` is older than this is ``ts_too_old``."""
    dedup_ttl_s: int = 7 * 86_400
    """How long an ``event_id`` is remembered in Redis for duplicate detection. Keep it
    at least ``max_age_s``: older events are rejected anyway."""
    dlq_duplicates: bool = False
    """Also dead-letter duplicates (reason ``duplicate``); by default they are counted and
    dropped, because producer retries make them routine."""
    group_id: str = "rtrl-ingest"
    """Consumer group of the ingest workers."""
    max_batch: int = 500
    """Most records per poll; one Kafka transaction covers one polled batch."""
    poll_timeout_ms: int = 500
    """Longest wait between two polls of a quiet raw topic (waits double from 10 ms up to
    it): how late the first record after a quiet spell is read, at most. An idle worker
    polls about 1000/this times a second (docs/ingest.md)."""
    max_poll_interval_ms: int = 30_000
    """A worker that does not poll for this long leaves the group. It is also how long a
    rebalance waits for members to rejoin, so it bounds the stall after a worker dies."""
    instance_id: str | None = None
    """Stable identity of one worker replica (e.g. its pod name). When set, it is the
    consumer's ``group.instance.id`` (static membership: a restarted worker takes its
    partitions back at once, without a rebalance) and part of the transactional id (the
    restarted worker fences its predecessor and aborts its open transaction at once).
    None: dynamic membership and a transactional id unique to the process. Two live
    workers must never share one."""
    transaction_timeout_ms: int = 15_000
    """The broker aborts a transaction left open this long (e.g. by a killed worker);
    read_committed consumers of the events topic wait at most this long behind it."""


class RewardSettings(Section):
    """The reward join service: batching, timers, transactions and the emitted markers."""

    group_id: str = "rtrl-reward"
    """Consumer group of the reward workers (on the events topic)."""
    max_batch: int = 500
    """Most events per poll; one Kafka transaction covers one polled batch and its closes."""
    poll_timeout_ms: int = 200
    """Longest wait between two polls of a quiet events topic while a window is open on the
    worker's partitions (waits double from 10 ms up to it): how late an event of an open
    window is read, at most. Timers do not wait for it: the worker wakes at each close time."""
    idle_poll_ms: int = 1000
    """Longest wait between two polls while no window is open on the worker's partitions:
    how late the first event after a quiet spell is read, at most. An idle worker polls
    about 1000/this times a second (docs/ingest.md). Values below ``poll_timeout_ms`` act as it."""
    max_close_per_batch: int = 2000
    """Most windows closed in one transaction (the rest close on the next loop)."""
    max_poll_interval_ms: int = 30_000
    """A worker that does not poll for this long leaves the group. It is also how long a
    rebalance waits for members to rejoin, so it bounds the stall after a worker dies (the
    client's own default, 5 minutes, would let one slow member hold the group that long)."""
    time_scale: float = 1.0
    """Multiplies every duration of the reward spec's window (horizons, grace, follow-up)
    when deciding *when* a window closes; horizons keep their names. 0.01 makes a 1 h
    horizon close after 36 s (demos, tests). Production: 1.0."""
    emitted_ttl_s: int = 7 * 86_400
    """How long Redis remembers that a request's reward was emitted; events for it within
    this time are counted as late. Keep it above the largest horizon plus any client delay."""
    transactional_id: str | None = None
    """Transactional id. None: ``rtrl-reward-<host>-<pid>-<random>``, unique per process.
    Set a stable id per replica (e.g. the StatefulSet pod name) so a restarted worker aborts
    its predecessor's open transaction at once instead of after ``transaction_timeout_ms``."""
    transaction_timeout_ms: int = 15_000
    """The broker aborts a transaction left open this long (e.g. by a killed worker)."""
    group_instance_id: str | None = None
    """Static consumer-group membership (KIP-345): a stable id per replica (e.g. the pod
    name) lets a restarted worker take its partitions back at once, without waiting for
    the broker to expire the dead member. Strongly recommended on noida-db, which does not
    expire a SIGKILLed member in useful time."""


class GateSettings(Section):
    """The offline gate every candidate passes before it may be canaried."""

    max_kl: Annotated[float, Field(gt=0.0)] = 2.0
    """Budget for KL(parent || candidate) in nats per completion on held-out records."""
    min_kl: Annotated[float, Field(ge=0.0)] = 1e-3
    """A candidate closer than this to its parent (same measure) fails: its training kept no
    step (e.g. the KL band backed off to where it started), and its canary would compare the
    champion with itself for the whole canary. 0: not checked."""
    min_ess: Annotated[float, Field(ge=0.0, le=1.0)] = 0.2
    """Smallest effective sample size of the importance weights, as a share of held-out records."""
    max_regression: Annotated[float, Field(ge=0.0)] = 0.1
    """Fail when the upper confidence bound of the candidate's estimated reward is this far
    below the logged (behavior) reward: a clear regression."""
    truncate: Annotated[float, Field(gt=1.0)] = 2.0
    """Per-token importance ratios are truncated at this value in the gate's estimate."""
    z: Annotated[float, Field(gt=0.0)] = 1.96
    """Normal quantile of the confidence interval (1.96: 95%)."""
    min_heldout: Annotated[int, Field(ge=0)] = 20
    """Fewer held-out records: the estimate is reported but not used to fail the candidate."""
    max_abs_loss: Annotated[float, Field(gt=0.0)] = 1e4
    """A training loss larger than this (in magnitude) fails the candidate."""
    max_mismatch: Annotated[float, Field(ge=0.0)] = 0.1
    """Largest train-inference mismatch of the parent: mean |log π_trainer − log π_engine| per
    token (nats) on the tokens it served, measured before the first step. Above it the trainer is
    not training the model the engine serves, and the candidate fails. 0: not checked."""


class BandSettings(Section):
    """A steady step: each increment aims at a KL to its parent inside ``[low, high]`` nats per
    completion, probed on the window's samples as the offline gate measures it on held-out
    ones. Training stops at the band's midpoint, backs off (learning rate halved) from a step
    that overshoots ``high``, and goes over the window up to ``max_epochs`` times while below
    it (trainer/trust_region.py; docs/trainer.md)."""

    enabled: bool = True
    """Off: each increment takes ``epochs`` passes over its window, whatever the KL."""
    low: Annotated[float, Field(ge=0.0)] = 1.0
    """Lower edge of the band (nats per completion)."""
    high: Annotated[float, Field(gt=0.0)] = 2.0
    """Upper edge; keep it at or below ``gate.max_kl`` so a candidate inside the band passes the gate."""
    target: Annotated[float, Field(ge=0.0)] | None = None
    """Where training stops, inside ``[low, high]`` (unset: the band's midpoint)."""
    probe_every: Annotated[int, Field(ge=1)] = 4
    """Optimiser steps between KL probes."""
    probe_size: Annotated[int, Field(ge=1)] = 512
    """Most records the KL is probed on: the gate's held-out records (a window with none held
    out: samples split off its training samples by the seed, at most a fifth of them)."""
    max_epochs: Annotated[int, Field(ge=1)] = 3
    """Most passes over the window while the KL is below the band's midpoint."""
    max_backoffs: Annotated[int, Field(ge=0)] = 3
    """Most overshoots before the increment stops at the last state inside the band."""
    max_length_change: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    """Length guard: a step that changes the mean completion length sampled on the probe's
    prompts by more than this fraction is an overshoot too (keep it below the deployer's
    length detector's tolerance, 0.25). Unset: no guard."""
    length_probe_size: Annotated[int, Field(ge=1)] = 128
    """Probe prompts the length guard samples one completion for, at each probe."""
    stall_probes: Annotated[int, Field(ge=1)] | None = 2
    """After a back-off, probes in a row that bring the KL no higher than the last kept state's
    before the increment stops there ("stalled"). Unset: train on over the whole window."""

    @model_validator(mode="after")
    def _ordered(self) -> BandSettings:
        if self.low >= self.high:
            raise ValueError(f"trainer.band: low ({self.low}) must be below high ({self.high})")
        if self.target is not None and not self.low <= self.target <= self.high:
            raise ValueError(f"trainer.band: target ({self.target}) must be inside [low, high] "
                             f"([{self.low}, {self.high}])")
        return self


class TriggerSettings(Section):
    """Start an increment before the interval once enough reward-complete records have arrived
    (trainer/cadence.py; docs/trainer.md)."""

    min_records: Annotated[int, Field(ge=0)] = 0
    """Records after the last window's cut that start an increment early; 0: the interval alone."""
    min_ess: Annotated[float, Field(ge=0.0)] = 0.0
    """And the effective sample size over users (Kish's) they must reach."""
    retry_s: Annotated[float, Field(ge=0.0)] = 600.0
    """After an increment the records started registers no candidate (it failed, or was skipped),
    the records trigger rests this long; the interval still applies."""


class TrainerSettings(Section):
    """RL increments (``rtrl serve trainer``, ``rtrl train --now``, ``rtrl bootstrap``)."""

    interval_s: Annotated[float, Field(gt=0.0)] = 5 * 3600.0
    """Seconds between scheduled increments (demos: a minute or two)."""
    misfire_grace_s: Annotated[int, Field(ge=1)] = 3600
    """A run missed (trainer down) by less than this still runs once at start-up."""
    run_on_start: bool = False
    """Also start one increment as soon as the scheduler starts."""
    check_every_s: Annotated[float, Field(gt=0.0)] = 30.0
    """How often the service looks at the records since the cut, the canary in flight and a
    due increment (an increment never starts while a canary is in flight)."""
    trigger: TriggerSettings = TriggerSettings()
    data_dir: Path = Path(".rtrl/trainer")
    """Scheduler job store, the pending window, Ray checkpoints and scratch space. On a Ray
    cluster, ``ray_storage`` must be shared storage instead."""
    base_model_dir: Path | None = None
    """Where the base model of LoRA versions is on this machine, when not at the path it was
    trained at (their ``policy.json``); checked against the version's content hash. Read from
    the environment by every process that loads a LoRA version (the trainer and its Ray workers)."""
    ray_storage: str | None = None
    """Ray Train storage_path (e.g. s3://bucket/rtrl); None: ``<data_dir>/ray``."""
    consumer_group: str = "rtrl-trainer"
    """Consumer group whose committed offsets on the rewards topic mark the last window's cut."""
    min_records: Annotated[int, Field(ge=1)] = 64
    """A window with fewer training records is skipped (and recorded) instead of trained."""
    max_records: Annotated[int, Field(ge=1)] = 200_000
    """Most records in one window; the rest wait for the next increment."""
    heldout_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.1
    """Share of the window (chosen by request_id hash) kept out of training for the gate."""
    group_size: Annotated[int, Field(ge=2)] = 8
    """Samples per advantage group (same-prompt groups when prompts repeat)."""
    normalize_std: bool = False
    """Divide advantages by the group's reward standard deviation (off: Dr. GRPO)."""
    train_on: Literal["champions", "all"] = "champions"
    """``champions``: learn only from completions served by versions that were champion; the
    records of canaries rolled back or aborted are consumed but not trained on. The service
    starts no increment while a canary is undecided, so its records are classified by its
    outcome (``rtrl train --now`` does not wait: it consumes an undecided canary's records
    without training on them)."""
    batch_size: Annotated[int, Field(ge=1)] = 32
    """Records per optimiser step."""
    epochs: Annotated[int, Field(ge=1)] = 1
    """Passes over the window (1: each record trained once) when ``band`` is off."""
    lr: Annotated[float, Field(gt=0.0)] = 3e-4
    """Adam learning rate (all parameters)."""
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    """The learning rate rises linearly to ``lr`` over this many steps (0: from the first)."""
    max_grad_norm: Annotated[float, Field(gt=0.0)] = 1.0
    """Gradients are clipped to this global norm before each step."""
    clip_low: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.2
    """PPO clip: ratios to the parent below 1 - clip_low stop pulling."""
    clip_high: Annotated[float, Field(ge=0.0)] = 0.28
    """PPO clip: ratios to the parent above 1 + clip_high stop pushing."""
    truncate_is: Annotated[float, Field(gt=0.0)] = 2.0
    """Truncation of the parent/behavior importance weights (staleness correction)."""
    kl_coef: Annotated[float, Field(ge=0.0)] = 0.02
    """Weight of the k3 KL term to the parent checkpoint (docs/trainer.md, the objective)."""
    checkpoint_every: Annotated[int, Field(ge=1)] = 50
    """Steps between Ray Train checkpoints (a killed increment resumes from the last one).
    A Ray checkpoint is persisted synchronously (~0.5 s for the default policy), so a short
    cadence costs throughput: with steps of ~0.15 s, every 10 steps the job ran at 0.83 of
    the plain loop, every 50 at 1.07 (docs/benchmarks.md). A kill loses at most this many
    steps of work."""
    registry_retry_s: Annotated[float, Field(ge=0.0)] = 300.0
    """After training, each MLflow call (step metrics, register, offer the candidate, close the
    run) is retried for this long (backoff 1 s doubling to 15 s) before the increment fails with
    its window pending; the next run then registers it. A window never gets two versions."""
    stop_grace_s: Annotated[float, Field(ge=0.0)] = 60.0
    """On SIGTERM, wait this long for a running increment to finish; after that the process
    exits and the next run resumes the same window from its last checkpoint."""
    seed: int = 0
    """Seeds shuffling and initialisation, so an increment on the same window is reproducible."""
    policy_kind: str = "tiny-transformer"
    """Kind of a policy made from scratch by ``rtrl bootstrap`` (hf: pass --hf-model)."""
    gate: GateSettings = GateSettings()
    band: BandSettings = BandSettings()


class UpstreamSettings(Section):
    """One OpenAI-compatible inference endpoint behind the gateway (upstream mode)."""

    base_url: str
    """Base URL without the ``/v1/completions`` path, e.g. ``http://vllm-stable:8000``."""
    model: str
    """Model name sent in the request body (as the inference server knows it)."""
    api_key: SecretStr | None = None
    """Sent as ``Authorization: Bearer ...`` when set."""
    version: str | None = None
    """Version label for served events when the routing table names none for this arm."""


class GatewaySettings(Section):
    """The serving gateway (``rtrl serve gateway``): HTTP API, routing, exposure logging."""

    host: str = "127.0.0.1"
    """Address the API binds to; 0.0.0.0 in containers."""
    port: int = 8080
    """Port of the API, which also serves /metrics, /healthz and /readyz."""
    max_body_bytes: int = 64 * 1024
    """Larger request bodies are refused with 413 before they are read."""
    listen_backlog: Annotated[int, Field(ge=1)] = 1024
    """Connections the kernel queues before the server accepts them (capped by the kernel's
    ``net.core.somaxconn``); beyond it new connections wait for SYN retransmits (1, 3, 7 s)."""
    max_connections: Annotated[int, Field(ge=1)] = 1024
    """Open client connections at once, per worker; when full, the longest-idle one is closed for a new
    one, and only when all are busy is a new one answered 503 (``Retry-After``). Requests to
    local policies run on a thread pool of this size; requests to an engine share at most
    this many connections to it."""
    max_connections_per_client: Annotated[int, Field(ge=1)] = 64
    """Open connections from one client address to one worker; one more is answered 429
    (``rate_limit_exceeded``) and closed. Behind a proxy every client shares its address: raise
    it to ``max_connections`` there."""
    header_timeout_s: Annotated[float, Field(gt=0.0)] = 10.0
    """A new connection must send its first request line and headers within this, and every
    later request its headers within this of its first byte; a silent connection is closed,
    a slow one answered 408."""
    read_timeout_s: Annotated[float, Field(gt=0.0)] = 10.0
    """Once its headers are in, a request's body must arrive within this; else 408 and the
    connection is closed."""
    idle_timeout_s: Annotated[float, Field(gt=0.0)] = 30.0
    """A kept-alive connection with no new request for this long is closed. Keep it above the
    idle timeout of load balancers in front of the gateway."""
    max_request_line_bytes: Annotated[int, Field(ge=64)] = 8192
    """Longest request line (method, path and query, version); longer: 414."""
    max_header_bytes: Annotated[int, Field(ge=256)] = 16 * 1024
    """Largest header block; larger, or more than 100 header lines: 431."""
    routing_poll_s: float = 1.0
    """How often the routing table is read from Redis (weight changes apply within this)."""
    champion_refresh_s: float = 10.0
    """How often the registry's ``champion`` alias is re-read when Redis names no stable version."""
    load_retry_s: float = 30.0
    """Wait before retrying a model version that failed to load."""
    default_max_tokens: int = Field(16, ge=1, le=256)
    """max_tokens of a request that does not say."""
    simulated_ms_per_token: float = Field(0.0, ge=0.0)
    """Simulated generation cost added to each completion's reported latency_ms (demo)."""
    sleep_simulated_latency: bool = False
    """Also sleep the simulated cost before answering, so clients feel it."""
    key_id: str | None = "gateway"
    """Key id that signs completion.served events; None sends them unsigned (development)."""
    secret: SecretStr | None = None
    """Signing secret; None: the secret of ``key_id`` in ``auth.keys``."""
    workers: Annotated[int, Field(ge=0)] = 0
    """Processes serving the API on one port (``rtrl serve gateway``); a worker that dies is
    replaced. 0, when models run on an engine (``engine.kind=vllm`` or upstream mode): one
    per core this process may use (its cgroup CPU limit, else its CPU affinity), no more than
    its cgroup memory limit holds at 320 MiB each (beyond 256 MiB for the rest), at most 8;
    1 for local policies (each worker would hold its own copy of every model)."""
    spool_dir: Path | None = None
    """Where ``rtrl serve gateway``'s workers spool served events until the broker has them
    (docs/gateway.md); None: ``<temp dir>/rtrl-gateway-<port>``. Keep it on a volume that
    outlives the container (an emptyDir in the chart) so a restart delivers what was left."""
    spool_max_bytes: Annotated[int, Field(ge=1 << 20)] = 1 << 30
    """Served events waiting in the spool; beyond this new ones are dropped and counted
    (``rtrl_gateway_exposures_total{result="dropped"}``)."""
    spool_max_age_s: Annotated[float, Field(gt=0.0)] = 24 * 3600.0
    """Served events spooled longer ago than this are dropped instead of sent: their
    reward windows have closed long since."""
    exposure_queue: int = 10_000
    """In-process gateways (tests, benchmarks): served events waiting for the broker; beyond
    this they are dropped and counted. ``rtrl serve gateway`` spools them on disk instead."""
    exposure_process: bool = True
    """In-process gateways: run the Kafka producer of served events in a child process, so
    its CPU work never holds the gateway's GIL (false: a background thread)."""
    exposure_linger_ms: int = 50
    """Producer batching delay for served events: larger batches cost the gateway far less
    CPU per event (kafka-python: ~1.3 ms per event unbatched vs ~0.5 ms at 50 ms)."""
    model_cache_dir: Path | None = None
    """Where downloaded model versions are kept; None: a temporary directory."""
    torch_threads: int = 1
    """Intra-op threads per generation; 1 keeps concurrent requests from fighting for cores."""
    min_tokens: Annotated[int, Field(ge=0)] = 0
    """Local policies: EOS cannot end a completion before this many tokens (1: never an empty
    answer; the logged log-probabilities are those of the distribution actually sampled).
    For an upstream, set its own equivalent (vLLM's ``min_tokens``)."""
    stable_upstream: UpstreamSettings | None = None
    """Upstream mode: forward the stable arm to this endpoint instead of a local policy."""
    canary_upstream: UpstreamSettings | None = None
    """Upstream mode: endpoint of the canary arm (None: no canary in upstream mode)."""
    api_keys: dict[str, SecretStr] = Field(default_factory=dict)
    """Client API keys, ``{"<key id>": "<key>"}``; clients send ``Authorization: Bearer <key>``.
    Without keys the gateway refuses to start unless ``allow_anonymous`` is set."""
    allow_anonymous: bool = False
    """Development only: serve requests that carry no API key (key id ``anonymous``)."""
    upstream_timeout_s: float = 30.0
    """Longest wait for an upstream engine's answer; past it the request fails (504)."""
    upstream_token_ids: Literal["require", "hash"] = "require"  # noqa: S105 (a mode, not a secret)
    """How upstream completion tokens become token ids in served events: ``require`` asks
    the server for ids (vLLM ``return_tokens_as_token_ids``) and fails the request (502)
    when it returns text tokens; ``hash`` maps text tokens to stable 31-bit hashes."""
