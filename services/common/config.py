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

Every key is a dataclass field made with `setting()` (settings.py): its default, one line of
meaning, and the values it takes (choices, bounds, one per class). That is the one source:
config_file.py checks a file against it and docs/configuration.md is generated from it
(services/common/config_doc.py).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.common.batch_config import BatchConfig
from services.common.responses_config import ResponsesConfig
from services.common.store_config import StoreConfig
from services.common.drain import DEFAULT_DRAIN_SECONDS
from services.common.settings import (NON_NEGATIVE, PORT, PORT_OR_OFF, POSITIVE, SHARE, Bounds,  # noqa: F401
                                      ConfigError, setting)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_CPU_KV_MB = 256
DEFAULT_KV_FRACTION = 0.8
POLICIES = ("qos", "fcfs")
ROUTING_MODES = ("cost", "primary", "slo-cost")           # RouterConfig.routing
SCHEDULER_LINKS = ("stream", "calls")                     # RouterConfig.scheduler_link
KV_CAP_MODES = ("strict", "elastic")                # SchedulerConfig.kv_cap_mode
LONG_PROMPTS = ("refuse", "stream")                 # SchedulerConfig.long_prompts
DECODE_ATTENTION = ("auto", "kernel", "torch")      # WorkerConfig / EngineConfig.decode_attention, prompt_attention
DEVICES = ("cuda", "npu", "cpu")
DTYPES = ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16")   # WorkerConfig.dtype


@dataclass(slots=True)
class ServiceConfig:
    """What every service's table has: where it listens, its metrics, how long it drains."""
    host: str = setting(DEFAULT_HOST, "address to listen on (loopback unless told otherwise)")
    port: int = setting(0, "gRPC port", bounds=PORT)
    metrics_port: int | None = setting(None, "Prometheus /metrics port (unset: off)",
                                       kind=int, bounds=PORT)
    drain_seconds: float = setting(DEFAULT_DRAIN_SECONDS, "on SIGTERM, how long requests in flight get to "
                                   "finish (new ones are refused meanwhile)", bounds=Bounds(0, 3600))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(slots=True)
class RouterConfig(ServiceConfig):
    port: int = setting(50051, "gRPC port of the router's front", bounds=PORT)
    routing: str = setting("cost", "pool choice: cost-aware rules (cost), everything on the primary pool "
                           "(primary), or the cheapest pool whose predicted TTFT meets the request's SLO "
                           "(slo-cost)", choices=ROUTING_MODES)
    admission: str = setting("priority", "the router's intake: High first through a burst (priority) or "
                             "arrival order (fifo)", choices=("priority", "fifo"))
    http_port: int = setting(8000, "port of the OpenAI-compatible HTTP front, on the same host",
                             bounds=PORT_OR_OFF)
    http_max_body_bytes: int = setting(4 * 2**20, "larger HTTP request bodies get 413, larger gRPC messages "
                                       "to the router RESOURCE_EXHAUSTED", bounds=Bounds(1024))
    http_read_timeout_s: float = setting(30.0, "an HTTP client that takes longer to send a request's headers, "
                                         "or between pieces of its body, gets 408 and is disconnected",
                                         bounds=POSITIVE)
    migration_limit: int = setting(3, "how often a request whose pool fails mid-way moves to another pool "
                                   "(with the tokens already streamed)", bounds=Bounds(0, 100))
    scheduler_link: str = setting("stream", "how requests reach a scheduler: one long-lived SubmitLink stream "
                                  "(stream) or a Submit call each (calls)", choices=SCHEDULER_LINKS)
    cache_scope: str = setting("tenant", "who shares cached prompt KV: requests of one tenant only (tenant; "
                               "the tenant the caller's key names when auth is on), or of every tenant "
                               "(cluster: a cache hit then tells a tenant that another sent that prefix); "
                               "a request's cache_salt narrows either", choices=("tenant", "cluster"))
    tls_cert: str = setting("", "PEM certificate for TLS on the gRPC and HTTP fronts (with tls_key; both "
                            "empty: plaintext)", note="a file")
    tls_key: str = setting("", "PEM private key for tls_cert", note="a file")

    @property
    def http_address(self) -> str | None:
        return None if self.http_port < 0 else f"{self.host}:{self.http_port}"


@dataclass(slots=True)
class SchedulerConfig(ServiceConfig):
    port: int = setting(50052, "gRPC port of the pool's scheduler", bounds=PORT)
    policy: str = setting("qos", "weighted fair queueing with KV caps and preemption (qos), or the "
                          "first-come-first-served baseline (fcfs)", choices=POLICIES)
    weights: list = setting(doc="each class's weight in weighted fair queueing of tokens",
                            factory=lambda: [5.0, 3.0, 2.0], per_class=True, bounds=POSITIVE)
    kv_caps: list = setting(doc="the share of each worker's KV blocks a class may hold",
                            factory=lambda: [1.0, 0.7, 0.3], per_class=True, bounds=SHARE)
    max_running: int = setting(64, "sequences holding KV blocks at once, per worker", bounds=Bounds(1))
    max_step_tokens: int = setting(512, "tokens per engine step (chunked prefill): bounds a step's time",
                                   bounds=Bounds(1), note=">= max_running")
    max_queue: int = setting(1024, "waiting requests per class before RESOURCE_EXHAUSTED", bounds=Bounds(1))
    retry_after_ms: int = setting(1000, "retry advice sent with RESOURCE_EXHAUSTED for a full queue",
                                  bounds=Bounds(1))
    tenant_fairness: bool = setting(True, "inside a class, tenants share by weight, not by arrival")
    kv_cap_mode: str = setting("strict", "caps always bind (strict), or a class borrows blocks beyond its cap "
                               "while no other class waits (elastic)", choices=KV_CAP_MODES)
    high_cut_in: bool = setting(True, "qos: a High request that can start while a worker computes a step runs "
                                "its first step inside that one (a cut-in)")
    high_cut_in_slots: float = setting(0.25, "qos: running slots beyond max_running that cut-ins may take, as "
                                       "a share of it (at least one while > 0; 0: none)", bounds=Bounds(0, 1))
    stream_intervals: list = setting(doc="tokens per stream chunk after the first, per class (a request's "
                                     "x-stream-interval overrides it)", factory=lambda: [1, 4, 16], kind=int,
                                     per_class=True, bounds=Bounds(1, 2**31 - 1))
    stream_max_hold_ms: float = setting(500.0, "the longest a chunk waits for the rest of its stream interval",
                                        bounds=Bounds(0, 60_000))
    workers_from: str = setting("config", "where the pool's workers come from: the configured addresses "
                                "(config), every address workers_dns resolves to (dns), or only workers that "
                                "register (join)", choices=("config", "dns", "join"))
    workers_dns: str = setting("", "with workers_from = dns: a headless Service's HOST:PORT",
                               note="HOST:PORT")
    workers_dns_interval_s: float = setting(5.0, "how often workers_dns is resolved again", bounds=POSITIVE)
    orphan_grace_s: float = setting(10.0, "with no worker left, how long requests wait for one to (re)join "
                                    "before they go back to the router (UNAVAILABLE) to move pools",
                                    bounds=POSITIVE)
    prefix_caching: bool = setting(True, "a new request shares the KV blocks of its longest prefix a worker has "
                                   "computed before (its own after a preemption) instead of computing them")
    cache_idle_shares: list = setting(doc="prefix caching: the most of a worker's KV blocks each class's idle "
                                      "cached blocks keep (idle blocks go when blocks run short all the same, "
                                      "Low's first)", factory=lambda: [1.0, 0.5, 0.2], per_class=True, bounds=SHARE)
    cache_affinity_margin: float = setting(0.25, "prefix caching: a request goes to the worker holding the longest "
                                           "cached prefix of it unless that worker runs more sequences than the "
                                           "least loaded one by more than this share of max_running",
                                           bounds=Bounds(0, 1))
    long_prompts: list = setting(doc="per class, a request whose prompt + max_tokens pass the model's context "
                                 "and that names no context_mode: refused (refuse) or served in streaming "
                                 "mode (stream: attention sinks + a recent window)",
                                 factory=lambda: ["refuse", "refuse", "stream"], kind=str, per_class=True,
                                 choices=LONG_PROMPTS)
    stream_sink_tokens: int = setting(4, "streaming mode: the first tokens every token attends (attention "
                                      "sinks)", bounds=Bounds(0), note="<= the workers' block_size")
    stream_window_tokens: int = setting(2048, "streaming mode: the most recent tokens every token attends",
                                        bounds=Bounds(1), note="sinks + window <= the model's context")
    stream_chunk_tokens: int = setting(256, "streaming mode: the largest prompt chunk of one step (a sequence "
                                       "holds at most the sink block and the blocks of window + chunk)",
                                       bounds=Bounds(1))
    stream_max_tokens: int = setting(131072, "streaming mode: the longest prompt + max_tokens accepted",
                                     bounds=Bounds(1))
    step_timeout_s: float = setting(30.0, "a worker slower than this to answer one step (idle ones get a "
                                    "heartbeat step every 0.5 s) counts as hung: its sequences are "
                                    "recomputed elsewhere and its stream is closed", bounds=POSITIVE)


@dataclass(slots=True)
class WorkerConfig(ServiceConfig):
    port: int = setting(50053, "gRPC port of the worker", bounds=PORT)
    device: str = setting("cpu", "what it runs on: cpu, cuda[:N] or npu[:N] (default: its pool's device)",
                          note="cpu, cuda[:N], npu[:N]")
    dtype: str | None = setting(None, "weights' and KV cache's dtype (default: bf16 where the device computes "
                                "it natively, CPUs with avx512_bf16 or amx_bf16 included; else fp32 on CPU, "
                                "fp16 on GPU/NPU)", kind=str, choices=DTYPES)
    threads: int = setting(1, "torch CPU threads, set explicitly in every worker", bounds=NON_NEGATIVE)
    kv_cache_mb: int | None = setting(None, "KV cache budget in MiB (unset: 256 on CPU, else by fraction)",
                                      kind=int, bounds=Bounds(1))
    kv_cache_fraction: float | None = setting(None, "share of free memory after the weights for the KV cache "
                                              "(unset: 0.8 on GPU/NPU)", kind=float, bounds=SHARE)
    block_size: int = setting(16, "tokens per KV block", bounds=Bounds(1, 1024))
    kv_tier_mb: int = setting(0, "second KV tier: MiB of host memory (or of kv_tier_path) keeping blocks the "
                              "KV cache evicts, loaded back instead of recomputed (0: none; needs prefix caching)",
                              bounds=NON_NEGATIVE)
    kv_tier_path: str | None = setting(None, "a file on local disk the second tier lives in, memory-mapped "
                                       "(unset: anonymous host memory); its contents do not outlive the worker",
                                       kind=str, note="path")
    max_loras: int = setting(4, "LoRA adapters on the device at once (and among its running sequences)",
                             bounds=Bounds(1), note="<= max_cpu_loras")
    max_cpu_loras: int = setting(16, "adapters kept in host memory; past it the least recently used idle one "
                                 "goes", bounds=Bounds(1))
    adapter_dirs: list | None = setting(None, "folders LoRA adapters may be loaded from at run time "
                                        "(/v1/load_lora_adapter): the path, links and .. resolved, must lie inside "
                                        "one, else 403 (unset: the pool's [[pools.adapters]] folders; []: none)",
                                        kind=list, note="folders")
    decode_attention: str = setting("auto", "decode attention on CPU (fp32, bf16): the paged C kernel where it builds "
                                    "and takes the model (head size a multiple of 16) (auto), that or refuse to start "
                                    "(kernel), or gather + SDPA (torch)", choices=DECODE_ATTENTION)
    prompt_attention: str = setting("auto", "prompt attention on CPU (fp32, bf16): the same paged C kernel (auto, "
                                    "kernel, as decode_attention) or SDPA over the gathered context (torch)",
                                    choices=DECODE_ATTENTION)
    batch_invariant: bool = setting(False, "ask for batch invariance (a token's logits the same bits whatever shares "
                                    "its step, however its prompt is chunked, and when it is recomputed: a "
                                    "failover's text equals the undisturbed one). It holds by default where the "
                                    "paged kernel attends decodes and prompts and the linear layers run on the C "
                                    "kernel (CPU, fp32, or bf16 with avx512_bf16); set, the worker logs a warning at "
                                    "start where it cannot (docs/models.md)")

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
    min_workers: int | None = setting(None, "fewest workers (default: the pool's configured workers)",
                                      kind=int, bounds=Bounds(1))
    max_workers: int | None = setting(None, "most workers (default: min_workers, no scaling)", kind=int,
                                      bounds=Bounds(1), note=">= min_workers")
    scale_out_high_backlog: int = setting(100, "High requests waiting above this: one more worker",
                                          bounds=Bounds(1))
    high_ttft_p99_ms: float | None = setting(None, "High TTFT P99 above this: one more worker (default: "
                                             "High's SLA)", kind=float, bounds=POSITIVE)
    kv_high: float = setting(0.9, "KV blocks in use above this share for kv_high_for_s: one more worker",
                             bounds=SHARE)
    kv_high_for_s: float = setting(30.0, "how long KV use must stay above kv_high", bounds=NON_NEGATIVE)
    scale_in_below: float = setting(0.25, "load ((running + waiting) / (workers x max_running)) below this for "
                                    "scale_in_after_s, nothing High waiting: one fewer", bounds=Bounds(0, 1))
    scale_in_after_s: float = setting(60.0, "how long the load must stay below scale_in_below",
                                      bounds=NON_NEGATIVE)
    scale_out_cooldown_s: float = setting(30.0, "after any change, no scale-out for this long",
                                          bounds=NON_NEGATIVE)
    scale_in_cooldown_s: float = setting(120.0, "after any change, no scale-in for this long", bounds=NON_NEGATIVE)


@dataclass(slots=True)
class AdapterConfig:
    """A LoRA adapter the pool's workers load at start ([[pools.adapters]])."""
    name: str = setting("", "what requests name (x-lora, X-Lora, or model: NAME over HTTP)", note="required")
    path: str = setting("", "a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)",
                        note="required")


@dataclass(slots=True)
class PoolConfig:
    """A pool: one scheduler and its workers, all on one kind of device."""
    name: str = setting("cpu", "the pool's name, reported as `pool` in every response", note="unique")
    device: str = setting("cpu", "what the pool's workers run on", choices=DEVICES)
    cost_per_token: float | None = setting(None, "price of a token here (default by device: cuda 1.0, npu 0.3, "
                                           "cpu 0.1)", kind=float, bounds=NON_NEGATIVE)
    primary: bool = setting(False, "takes High when there is no GPU pool")
    lora: bool = setting(False, "preferred for LoRA requests (the reference design: NPUs)")
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
class AuthConfig:
    required: bool = setting(False, "every request needs `authorization: Bearer <key>`")
    admin_key: str = setting("", "the key that sees everything (also from $QOS_ADMIN_KEY)")
    replicas: int = setting(1, "router replicas; above 1 they share each tenant's rpm/tpm/max_concurrent "
                            "through the store (one database for all of them)",
                            bounds=Bounds(1))


@dataclass(slots=True)
class SecurityConfig:
    tokens_dir: str = setting("", "a token per role on the internal hops: a folder with this role's ROLE.token, "
                              "which every call it makes to a scheduler or worker carries, and `roles`, each "
                              "role's token digest, by which it knows its callers (also $QOS_CLUSTER_TOKEN and "
                              "$QOS_CLUSTER_ROLES; `qos-serve tokens init DIR` makes one, `qos-serve up` makes "
                              "one when none is set)", note="a folder")
    certs_dir: str = setting("", "mutual TLS on the internal hops: a folder with ca.pem and each role's "
                             "ROLE.pem and ROLE.key, each certificate naming its role (`qos-serve certs init DIR` makes one)", note="a folder")


@dataclass(slots=True)
class BillingConfig:
    multipliers: list = setting(doc="cost units = tokens x the pool's cost per token x this, per class",
                                factory=lambda: [3.0, 1.5, 1.0], per_class=True, bounds=NON_NEGATIVE)
    flush_seconds: float = setting(1.0, "ledger rows are written in batches this often", bounds=POSITIVE)
    max_pending_rows: int = setting(100_000, "ledger rows the router keeps while the store cannot take them; "
                                    "past this the oldest are dropped (counted in qos_ledger_rows_dropped)",
                                    bounds=Bounds(1))
    cached_prompt_fraction: float = setting(0.5, "a prompt token served from the prefix cache costs this share "
                                            "of a computed one", bounds=Bounds(0, 1))


SLA_OBJECTIVES = ("ttft_p99_ms", "e2e_p99_ms", "tpot_p99_ms", "success_rate")


@dataclass(slots=True)
class SlaConfig:
    """An SLA contract ([[sla]]): objectives for one class (and optionally one tenant), judged over
    a rolling window of every request the router relays (services/control/sla.py)."""
    priority: str = setting("high", "the class the contract is for", choices=("high", "medium", "low"))
    tenant: str = setting("", "one tenant's requests only (empty: all tenants of the class together)")
    ttft_p99_ms: float | None = setting(None, "objective: time to first token, P99", kind=float, bounds=POSITIVE)
    e2e_p99_ms: float | None = setting(None, "objective: end to end, P99", kind=float, bounds=POSITIVE)
    tpot_p99_ms: float | None = setting(None, "objective: time per output token after the first, P99",
                                        kind=float, bounds=POSITIVE)
    success_rate: float | None = setting(None, "objective: share of requests served (client errors and "
                                         "cancels not counted)", kind=float, bounds=SHARE)
    window_s: float = setting(60.0, "the rolling window the objectives are judged over", bounds=Bounds(1, 86400))
    for_seconds: float = setting(30.0, "a breach must hold this long before the alert fires",
                                 bounds=Bounds(0, 86400))
    hysteresis: float = setting(0.1, "resolve only once better than the objective by this share",
                                bounds=Bounds(0, 0.9))
    resolve_seconds: float | None = setting(None, "... for this long (default: for_seconds)", kind=float,
                                            bounds=Bounds(0, 86400))
    min_requests: int = setting(10, "fewer requests in the window: no verdict (no alert)", bounds=Bounds(1))

    def objectives(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in SLA_OBJECTIVES if getattr(self, name) is not None}


def default_slas() -> list[SlaConfig]:
    """The promise qos-serve is judged on: High's first token within 200 ms at P99, and High
    served (not refused or failed) 99.9% of the time."""
    return [SlaConfig(priority="high", ttft_p99_ms=200.0, success_rate=0.999)]


@dataclass(slots=True)
class AlertsConfig:
    webhooks: list = setting(doc="URLs each alert transition is POSTed to", factory=list, kind=list,
                             note="http:// or https:// URLs")
    evaluate_every_s: float = setting(1.0, "how often SLA windows are judged", bounds=Bounds(0.05, 60))
    webhook_timeout_s: float = setting(5.0, "one webhook call's timeout", bounds=Bounds(0, 300, open_low=True))
    webhook_retries: int = setting(5, "retries after the first try, with backoff 0.5, 1, 2, 4 ... s",
                                   bounds=Bounds(0, 100))


@dataclass(slots=True)
class ClusterConfig:
    model: str = setting("default", "the embedded SmolLM2-135M-Instruct (default), or a Hugging Face model folder")
    router: RouterConfig = field(default_factory=RouterConfig)
    pools: list[PoolConfig] = field(default_factory=lambda: [PoolConfig()])
    store: StoreConfig = field(default_factory=StoreConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    billing: BillingConfig = field(default_factory=BillingConfig)
    sla: list[SlaConfig] = field(default_factory=default_slas)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    batches: BatchConfig = field(default_factory=BatchConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)

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
