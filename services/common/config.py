"""The cluster configuration: one file (TOML, or JSON with the same shape) for every service.

    model = "default"                 # the embedded SmolLM2-135M-Instruct, or a model folder

    [router]
    port = 50051

    [scheduler]
    port = 50052
    policy = "qos"

    [[workers]]
    port = 50053
    device = "cpu"
    threads = 1
    kv_cache_mb = 256

A port of 0 means "pick a free one" (`qos-serve up` resolves them before starting anything).
Services bind to loopback unless a host is given.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.common.drain import DEFAULT_DRAIN_SECONDS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_CPU_KV_MB = 256
DEFAULT_KV_FRACTION = 0.8
POLICIES = ("qos", "fcfs")
FIRST_TOKEN_MODES = ("wfq", "ahead", "exclusive", "alone")   # SchedulerConfig.high_first_token
ROUTING_MODES = ("cost", "primary", "slo-cost")           # RouterConfig.routing
SCHEDULER_LINKS = ("stream", "calls")                     # RouterConfig.scheduler_link
KV_CAP_MODES = ("strict", "elastic")                # SchedulerConfig.kv_cap_mode
DECODE_ATTENTION = ("auto", "kernel", "torch")      # WorkerConfig / EngineConfig.decode_attention
CPU_BINDINGS = ("auto", "off")                      # ClusterConfig.cpu_binding


class ConfigError(ValueError):
    """The configuration file is wrong; the message names the key."""


@dataclass(slots=True)
class ServiceConfig:
    """What every service's table has: where it listens, its metrics, how long it drains."""
    host: str = DEFAULT_HOST
    port: int = 0
    metrics_port: int | None = None   # Prometheus /metrics; None = off, 0 = a free port
    # On SIGTERM: requests in flight get this long to finish (new ones are refused meanwhile).
    drain_seconds: float = DEFAULT_DRAIN_SECONDS
    # CPU cores this service runs on, every thread of it (services/common/cpu_binding.py); empty:
    # wherever the kernel puts it. LocalCluster fills them in under cpu_binding = "auto".
    cpu_cores: list = field(default_factory=list)
    # Added to the nice value of every thread of the service at start (0..19; lowering one needs
    # privileges): on a host it shares, the service yields the CPU to those at a lower value.
    nice: int = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(slots=True)
class RouterConfig(ServiceConfig):
    port: int = 50051
    # "cost": cost-aware rules; "primary": all on the primary; "slo-cost": the cheapest pool whose
    # predicted time to first token meets the request's SLO (services/router/latency_model.py)
    routing: str = "cost"
    admission: str = "priority"       # "priority": High first through a burst; "fifo": arrival order
    # The OpenAI-compatible HTTP front (same host): 0 = a free port, -1 = off.
    http_port: int = 8000
    # A flood of calls is the router's own CPU work (gRPC's per call, ~1 ms each): on a host
    # shared with workers it yields to their engines, whose steps a High request's first token is
    # computed inside (services/common/cpu_binding.py, nice_process).
    nice: int = 2
    # A gRPC port of its own for High (real-time) requests (services/router/high_lane.py), beside
    # `port`: its calls are accepted apart from a flood's on the main port. 0 = a free port,
    # -1 = off. It takes only High requests (no x-priority there means high).
    high_port: int = -1
    http_max_body_bytes: int = 4 * 2**20    # larger request bodies get 413
    # A request whose pool fails mid-way (its scheduler died, or it has no worker left) moves to
    # another pool that serves the model, with the tokens already streamed: at most this often.
    migration_limit: int = 3
    # Medium or Low requests of one class in flight to one pool at once; more wait in the router
    # and go on as those finish (services/router/forward_window.py). High and requests with an
    # SLO are never held. 0 (the default): forward everything at once. Off by default: in two
    # alternating full-scale burst pairs it did not lower High's tail (docs/performance.md).
    forward_window: int = 0
    # While a High request waits for its first token, Medium and Low requests wait before
    # validation and their forward, for at most this many ms from when that wait began
    # (services/common/first_token_watch.py): the CPU goes to the first token. 0: off.
    first_token_hold_ms: float = 50.0
    # How requests reach a pool's scheduler: "stream", all of them over one long-lived SubmitLink
    # stream (services/router/scheduler_link.py; 23-35% less CPU a request in router and scheduler),
    # or "calls", a Submit call each (what a scheduler without SubmitLink gets either way).
    scheduler_link: str = "stream"
    # TLS on the router's gRPC and HTTP fronts (PEM files); both empty: plaintext.
    tls_cert: str = ""
    tls_key: str = ""

    @property
    def http_address(self) -> str | None:
        return None if self.http_port < 0 else f"{self.host}:{self.http_port}"

    @property
    def high_address(self) -> str | None:
        return None if self.high_port < 0 else f"{self.host}:{self.high_port}"


@dataclass(slots=True)
class SchedulerConfig(ServiceConfig):
    port: int = 50052
    policy: str = "qos"               # "qos" (fair queueing, caps, preemption) or "fcfs" (baseline)
    weights: list = field(default_factory=lambda: [5.0, 3.0, 2.0])    # High, Medium, Low tokens
    kv_caps: list = field(default_factory=lambda: [1.0, 0.7, 0.3])    # share of each worker's KV
    max_running: int = 64             # sequences holding KV blocks at once, per worker (and see high_cut_in_slots)
    max_step_tokens: int = 512        # tokens per engine step: bounds step time (chunked prefill)
    max_queue: int = 1024             # waiting requests per class before RESOURCE_EXHAUSTED
    retry_after_ms: int = 1000        # advice sent with RESOURCE_EXHAUSTED for a full queue
    tenant_fairness: bool = True      # qos: inside a class, tenants share by weight, not arrival
    # qos: a High request waiting for its first token goes ahead of the fair-queueing order
    # ("ahead"), also keeping other classes to decodes in that step ("exclusive"), with nothing
    # else in that step when its prompt fits ("alone", the default since 2026-12-02: a High
    # request that cannot cut in then waits for a short step, not one carrying every decode), or
    # not ("wfq")
    high_first_token: str = "alone"
    # qos: "strict" caps always bind; "elastic" lets a class borrow blocks beyond its cap while no
    # other class waits, and takes them back by preemption when a higher class needs them
    kv_cap_mode: str = "strict"
    # qos: > 0 keeps each step to about this many ms (by the pool's measured step time) while High
    # requests are in the pool: the step in flight when a High request arrives is short, at some
    # cost in the other classes' throughput. 0: off
    high_step_ms: float = 0.0
    # qos: a High request that can start at once while a worker computes a step has its first
    # step run inside that one, at a pause in its forward pass (a cut-in), rather than after it
    high_cut_in: bool = True
    # qos: running slots beyond max_running that High cut-ins may take, as a share of it (at least
    # one while > 0): a cut-in cannot preempt, and under a flood every slot is taken. 0: cut-ins
    # stay within max_running (for a worker whose memory or batch shapes allow no more). A quarter
    # since 2026-12-04 (an eighth before: two full-scale bursts, docs/performance.md)
    high_cut_in_slots: float = 0.25
    # qos: while a High request waits for its first token, Medium and Low requests wait before
    # tokenizing and admission, for at most this many ms from when that wait began
    # (services/common/first_token_watch.py). 0: off.
    first_token_hold_ms: float = 50.0
    # Tokens per stream chunk after the first, per class (High, Medium, Low): a stream's tokens are
    # held until it has this many (a request's x-stream-interval overrides it), and never longer
    # than stream_max_hold_ms. The first token's chunk and the last go at once. Fewer messages
    # through scheduler, router and client: CPU for the steps and for High's requests.
    stream_intervals: list = field(default_factory=lambda: [1, 4, 16])
    stream_max_hold_ms: float = 500.0
    # Added to the process's nice value for the thread that tokenizes each class's prompts (High,
    # Medium, Low; Linux): under a burst, long Medium and Low prompts are tokenized on the CPU time
    # a shared machine's engine, event loops and High's prompts leave (+15 and +19 since
    # 2026-12-02: at +5 and +10 Medium's took a fifth of a core in the flood's first second; see
    # docs/performance.md). 0: the process's priority.
    tokenizer_nice: list = field(default_factory=lambda: [0, 15, 19])
    # Per class (High, Medium, Low): prompts of up to this many characters (prompt and messages'
    # contents) are tokenized on the event loop itself, longer ones in the class's tokenizer thread.
    # The hop to a thread and back costs more CPU than encoding a short prompt, and while the loop
    # is busy it waits for the GIL on both sides: High's first token should not (tokenizer_threads.py).
    # 0: always the thread. The FCFS baseline uses Medium's for every class.
    tokenize_inline_chars: list = field(default_factory=lambda: [8192, 512, 512])
    # Where the pool's workers come from: "config" (dial the [[pools.workers]] addresses), "dns"
    # (every address workers_dns resolves to, re-resolved every workers_dns_interval_s: a
    # Kubernetes headless Service), or "join" (only workers that register: `qos-serve worker
    # --join`). Workers may register in every mode; [[pools.workers]] stays their settings.
    workers_from: str = "config"
    workers_dns: str = ""             # "qos-workers.ns.svc.cluster.local:50053"
    workers_dns_interval_s: float = 5.0
    # With no worker to serve (all failed or left), how long requests wait for one to (re)join
    # before they are handed back to the router (UNAVAILABLE) to be moved to another pool.
    orphan_grace_s: float = 10.0
    step_timeout_s: float = 120.0     # a worker slower than this to answer one step counts as gone


@dataclass(slots=True)
class WorkerConfig(ServiceConfig):
    port: int = 50053
    device: str = "cpu"
    dtype: str | None = None          # default: fp32 on CPU, bf16 on CUDA, fp16 on NPU
    threads: int = 1                  # torch CPU threads, set explicitly in every worker
    kv_cache_mb: int | None = None    # KV budget in MiB; unset: 256 on CPU, else by fraction
    kv_cache_fraction: float | None = None  # of free memory after the weights; unset: 0.8 on GPU/NPU
    block_size: int = 16
    max_loras: int = 4                # LoRA adapters on the device at once (and among its running sequences)
    max_cpu_loras: int = 16           # adapters loaded in host memory; past it the least recently used idle one goes
    # "auto": CPU fp32 workers attend decodes with the paged C kernel where it builds; "kernel":
    # that or refuse to start; "torch": gather + SDPA (services/engine/paged_attention.py).
    decode_attention: str = "auto"

    def kv_budget(self) -> tuple[int | None, float]:
        """(explicit KV bytes or None, share of free memory used when there are none). An
        accelerator's memory is there for the KV cache, so it takes most of what the weights leave;
        a CPU worker shares RAM with everything else, so it takes a fixed budget."""
        fraction = self.kv_cache_fraction if self.kv_cache_fraction is not None else DEFAULT_KV_FRACTION
        if self.kv_cache_mb is not None:
            return self.kv_cache_mb * 2**20, fraction
        if self.kv_cache_fraction is None and self.device.startswith("cpu"):
            return DEFAULT_CPU_KV_MB * 2**20, fraction
        return None, fraction


@dataclass(slots=True)
class AutoscaleConfig:
    """When a pool wants one worker more or one fewer (its scheduler's `desired_workers`): see
    services/scheduler/autoscale.py for the rule. `qos-serve up --autoscale` acts on it locally,
    KEDA on Kubernetes."""
    min_workers: int | None = None    # default: the pool's configured workers
    max_workers: int | None = None    # default: min_workers (no scaling)
    scale_out_high_backlog: int = 100     # High requests waiting above this: one more worker
    high_ttft_p99_ms: float | None = None  # High TTFT P99 above this: one more (default: High's SLA)
    kv_high: float = 0.9              # KV blocks in use above this share ...
    kv_high_for_s: float = 30.0       # ... for this long: one more
    scale_in_below: float = 0.25      # load (running + waiting) / (workers x max_running) below this ...
    scale_in_after_s: float = 60.0    # ... for this long, nothing High waiting: one fewer
    scale_out_cooldown_s: float = 30.0    # after any change, no scale-out for this long
    scale_in_cooldown_s: float = 120.0    # after any change, no scale-in for this long


@dataclass(slots=True)
class AdapterConfig:
    """A LoRA adapter the pool's workers load at start ([[pools.adapters]])."""
    name: str = ""                    # what requests name (x-lora, X-Lora, or model: NAME over HTTP)
    path: str = ""                    # a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)


@dataclass(slots=True)
class PoolConfig:
    """A pool: one scheduler and its workers, all on one kind of device."""
    name: str = "cpu"                 # reported as `pool` in every response
    device: str = "cpu"               # cuda | npu | cpu: what the pool's workers run on
    cost_per_token: float | None = None   # default by device: cuda 1.0, npu 0.3, cpu 0.1
    primary: bool = False             # takes High when there is no GPU pool
    lora: bool = False                # prefer this pool for LoRA requests (the reference design: NPUs)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workers: list[WorkerConfig] = field(default_factory=lambda: [WorkerConfig()])
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    adapters: list[AdapterConfig] = field(default_factory=list)

    def worker_limits(self) -> tuple[int, int]:
        """(min, max) workers for autoscaling; equal when the pool does not scale."""
        low = self.autoscale.min_workers if self.autoscale.min_workers is not None else len(self.workers)
        high = self.autoscale.max_workers if self.autoscale.max_workers is not None else low
        return low, max(low, high)


@dataclass(slots=True)
class StoreConfig:
    """The tenant and billing database (services/store/)."""
    url: str = ""                     # "" = SQLite in the cache folder; or postgresql://user@host/db


@dataclass(slots=True)
class AuthConfig:
    required: bool = False            # true: every request needs `authorization: Bearer <key>`
    admin_key: str = ""               # sees everything; also from $QOS_ADMIN_KEY
    replicas: int = 1                 # router replicas sharing the tenants' rpm/tpm/concurrency


@dataclass(slots=True)
class BillingConfig:
    # Cost units = (prompt + completion tokens) x the pool's cost per token x this, by class.
    multipliers: list = field(default_factory=lambda: [3.0, 1.5, 1.0])   # High, Medium, Low
    flush_seconds: float = 1.0        # ledger rows are written in batches this often


SLA_OBJECTIVES = ("ttft_p99_ms", "e2e_p99_ms", "tpot_p99_ms", "success_rate")


@dataclass(slots=True)
class SlaConfig:
    """An SLA contract ([[sla]]): objectives for one class (and optionally one tenant), judged over
    a rolling window of every request the router relays (services/control/sla.py)."""
    priority: str = "high"
    tenant: str = ""                  # "" = all tenants of the class together
    ttft_p99_ms: float | None = None  # time to first token, P99
    e2e_p99_ms: float | None = None   # end to end, P99
    tpot_p99_ms: float | None = None  # time per output token after the first, P99
    success_rate: float | None = None  # share of requests served (client errors, cancels not counted)
    window_s: float = 60.0
    for_seconds: float = 30.0         # a breach must hold this long before the alert fires
    # Resolve only once the observed value is better than the objective by this share (latency
    # below objective x (1 - h); errors below the error budget x (1 - h)) for resolve_seconds
    # (default: for_seconds): a value wobbling around the line does not open and close alerts.
    hysteresis: float = 0.1
    resolve_seconds: float | None = None
    min_requests: int = 10            # fewer requests in the window: no verdict (no alert)

    def objectives(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in SLA_OBJECTIVES if getattr(self, name) is not None}


def default_slas() -> list[SlaConfig]:
    """The promise qos-serve is judged on: High's first token within 200 ms at P99, and High
    served (not refused or failed) 99.9% of the time."""
    return [SlaConfig(priority="high", ttft_p99_ms=200.0, success_rate=0.999)]


@dataclass(slots=True)
class AlertsConfig:
    webhooks: list = field(default_factory=list)   # URLs: each alert transition is POSTed there
    evaluate_every_s: float = 1.0
    webhook_timeout_s: float = 5.0
    webhook_retries: int = 5          # after the first try, with backoff 0.5, 1, 2, 4 ... s


@dataclass(slots=True)
class ClusterConfig:
    model: str = "default"
    router: RouterConfig = field(default_factory=RouterConfig)
    pools: list[PoolConfig] = field(default_factory=lambda: [PoolConfig()])
    store: StoreConfig = field(default_factory=StoreConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    billing: BillingConfig = field(default_factory=BillingConfig)
    sla: list[SlaConfig] = field(default_factory=default_slas)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    # "auto": a local cluster (`qos-serve up`, the benchmarks) gives each worker cores of its own
    # and the router and schedulers the rest, where the machine has a core to spare for them
    # (services/common/cpu_binding.py); "off": every service wherever the kernel puts it.
    cpu_binding: str = "auto"

    def sla_ttft_ms(self, priority: str) -> float | None:
        """The class-wide TTFT objective for a class, if an SLA sets one (autoscaling uses High's)."""
        return next((s.ttft_p99_ms for s in self.sla if s.priority == priority and not s.tenant
                     and s.ttft_p99_ms is not None), None)

    def pool(self, name: str | None) -> PoolConfig:
        """The named pool, or the first one."""
        if name is None:
            return self.pools[0]
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise ConfigError(f"no pool named {name!r}; pools: {', '.join(p.name for p in self.pools)}")

    def to_dict(self) -> dict:
        return asdict(self)

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2))


def single_pool(router: RouterConfig | None = None, scheduler: SchedulerConfig | None = None,
                workers: list[WorkerConfig] | None = None, model: str = "default",
                name: str = "cpu") -> ClusterConfig:
    """A one-pool cluster (what the top-level [scheduler] and [[workers]] tables describe)."""
    return ClusterConfig(model=model, router=router or RouterConfig(), pools=[PoolConfig(
        name=name, primary=True, scheduler=scheduler or SchedulerConfig(),
        workers=workers or [WorkerConfig()])])
