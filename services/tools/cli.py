"""qos-serve: the command line.

    qos-serve up [--config FILE]                 router + scheduler + worker(s) on loopback
    qos-serve generate --priority high "prompt"  stream an answer through the router
                                                 (--file DOC appends a document to the prompt)
    qos-serve demo                               a local cluster serving a mixed-priority burst
    qos-serve stats [--watch]                    the cluster per priority
    qos-serve drain worker HOST:PORT [--wait]    a worker finishes what it holds and leaves
    qos-serve tenants|keys|billing ...           tenants, API keys, the bill (services/tools/admin_cli.py)
    qos-serve certs|tokens init DIR              the cluster's credentials (services/tools/trust_cli.py)
    qos-serve router|scheduler|worker --config FILE [--index N]   one service
    qos-serve worker ... --join SCHEDULER [--port N] [--advertise HOST:PORT]   join a pool at run time
"""
from __future__ import annotations

import os

# Before anything imports torch: never let torch auto-load device extensions. torch_npu installed
# without the CANN stack would otherwise break `import torch` in every service; the NPU backend
# imports it itself, guarded (services/engine/device.py).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from services.local.cluster import die_with_parent_if_asked  # noqa: E402

die_with_parent_if_asked()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from services.common.config import ConfigError  # noqa: E402
from services.common.config_file import load_config  # noqa: E402
from services.common.grpc_server import setup_logging  # noqa: E402
from services.common.priority import LABELS  # noqa: E402


def _client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=os.environ.get("QOS_API_KEY"),
                        help="sent as 'authorization: Bearer' (default: $QOS_API_KEY)")
    parser.add_argument("--tls-ca", metavar="PEM", help="the router serves TLS: trust this certificate")


def _config_args(parser: argparse.ArgumentParser, *, nested: bool = False) -> None:
    """--config and --log-level. nested: a sub-subcommand's copy (`tenants add NAME --config F`); its
    defaults are suppressed, or argparse would overwrite a value given before it (`tenants --config F add`)."""
    parser.add_argument("--config", default=argparse.SUPPRESS if nested else None,
                        help="cluster config (TOML or JSON); default: built-in defaults")
    parser.add_argument("--log-level", default=argparse.SUPPRESS if nested else "INFO")


def cluster_trust(config, role: str):
    """This process's token and certificates for the internal hops (services/common/cluster_auth.py)."""
    from services.common.cluster_auth import ClusterTrust
    return ClusterTrust.load(config.security, role)


def cmd_up(args) -> int:
    from services.local.cluster import LocalCluster, run_until_signal
    config = load_config(args.config)
    if not config.auth.admin_key and not os.environ.get("QOS_ADMIN_KEY"):
        # The admin endpoints (adapters, the console's cluster view) need one in every mode: a
        # key for this cluster alone, printed once it is up.
        import secrets
        config.auth.admin_key = secrets.token_urlsafe(16)
    run_until_signal(LocalCluster(config, autoscale=args.autoscale, supervise=True))
    return 0


def cmd_worker(args) -> int:
    config = load_config(args.config)
    pool = config.pool(args.pool)
    if not 0 <= args.index < len(pool.workers):
        raise ConfigError(f"--index {args.index}: pool {pool.name} has {len(pool.workers)} worker(s)")
    worker = pool.workers[args.index]
    if args.port is not None:
        from services.common.ports import free_port
        worker.port = args.port or free_port(worker.host)
    advertised = args.advertise or worker.address      # where the scheduler reaches us
    if args.listen:
        worker.host = args.listen
    if args.device and (":" in args.device or args.device != worker.device.split(":")[0]):
        worker.device = args.device      # a bare kind ("cuda") keeps the configured index

    trust = cluster_trust(config, "worker")     # a bad certificate fails before any model work too
    # The device first: a missing GPU or NPU stack fails in seconds, before any model work.
    from services.engine.device import open_backend
    try:
        backend = open_backend(worker.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    from services.engine.engine import Engine
    from services.local.cluster import resolve_model
    from services.worker.server import build_engine_config, serve_worker
    engine = Engine(build_engine_config(resolve_model(config.model), worker), backend)
    from services.engine.lora import AdapterError
    for adapter in pool.adapters:
        try:
            engine.load_adapter(adapter.name, Path(adapter.path).expanduser())
        except AdapterError as exc:
            raise ConfigError(f"pool {pool.name}: adapter {adapter.name}: {exc}") from exc
    adapter_dirs = [a.path for a in pool.adapters] if worker.adapter_dirs is None else worker.adapter_dirs
    from services.engine.kv_tier import KVTier
    tier = KVTier.sized(engine.cache, worker.kv_tier_mb * 2**20, worker.kv_tier_path) if worker.kv_tier_mb else None
    asyncio.run(serve_worker(engine, worker.address, worker.host, worker.metrics_port,
                             worker.drain_seconds, join=args.join, advertise=advertised,
                             trust=trust, adapter_dirs=adapter_dirs, tier=tier))
    return 0


def cmd_drain(args) -> int:
    """Ask a worker to drain (as SIGTERM does); with --wait, until it has left."""
    import time

    import grpc

    from services.common.proto.qos.v1 import worker_pb2, worker_pb2_grpc

    trust = cluster_trust(load_config(args.config), "admin")
    with trust.sync_channel(args.address, "worker") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            reply = stub.Drain(worker_pb2.DrainRequest(), timeout=10, metadata=trust.metadata)
        except grpc.RpcError as exc:
            print(f"qos-serve drain: worker {args.address}: {exc.code().name}: {exc.details()}",
                  file=sys.stderr)
            return 1
        print(f"worker {args.address} drains: {reply.active_sequences} sequence(s) to finish", flush=True)
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:
            try:
                stub.Info(worker_pb2.InfoRequest(), timeout=2, metadata=trust.metadata)
            except grpc.RpcError:
                print(f"worker {args.address} has left")
                return 0
            time.sleep(0.5)
    if args.wait:
        print(f"worker {args.address} still there after {args.wait:.0f} s", file=sys.stderr)
        return 1
    return 0


def cmd_scheduler(args) -> int:
    config = load_config(args.config)
    from services.local.cluster import resolve_model
    from services.scheduler.autoscale import ScaleAdvisor
    from services.scheduler.server import serve_scheduler
    pool = config.pool(args.pool)
    if args.listen:
        pool.scheduler.host = args.listen
    advisor = ScaleAdvisor(pool.autoscale, *pool.worker_limits(), config.sla_ttft_ms("high"))
    asyncio.run(serve_scheduler(pool.scheduler, pool.name, resolve_model(config.model),
                                [w.address for w in pool.workers], advisor, cluster_trust(config, "scheduler")))
    return 0


def cmd_router(args) -> int:
    config = load_config(args.config)
    if args.listen:
        config.router.host = args.listen
    for name in ("port", "http_port", "metrics_port"):        # another replica beside the configured one
        if getattr(args, name) is not None:
            setattr(config.router, name, getattr(args, name))
    from services.local.cluster import resolve_model
    from services.router.server import serve_router
    asyncio.run(serve_router(config, Path(resolve_model(config.model)).name))
    return 0


def cmd_generate(args) -> int:
    import grpc

    from services.common.proto.qos.v1 import router_pb2
    from services.tools.client import RouterClient, chat_request, sampling_params
    address = args.router or load_config(args.config).router.address
    sampling = sampling_params(max_tokens=args.max_tokens, temperature=args.temperature)
    prompt = args.prompt
    if args.file:       # a document after the prompt (e.g. "Summarise this." --file report.txt)
        prompt += "\n\n" + (sys.stdin.read() if args.file == "-" else Path(args.file).read_text())
    request = (router_pb2.GenerateRequest(prompt=prompt, sampling=sampling) if args.raw
               else chat_request(prompt, sampling))

    async def run() -> int:
        async with RouterClient(address, args.api_key, args.tls_ca) as client:
            try:
                answer = await client.generate(request, priority=args.priority, tenant=args.tenant,
                                               on_text=lambda t: print(t, end="", flush=True),
                                               context_mode=args.context_mode)
            except grpc.aio.AioRpcError as exc:
                print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
        print()
        print(f"[{args.priority or 'medium'} | pool {answer.pool} | cost {answer.cost_units:.1f} | "
              f"{len(answer.token_ids)} tokens | "
              f"TTFT {answer.ttft_ms:.0f} ms | total {answer.e2e_ms:.0f} ms | {answer.finish_reason}"
              + (f" | streaming mode: {answer.streaming[0]} sinks + a {answer.streaming[1]}-token window"
                 if answer.streaming else "") + "]",
              file=sys.stderr)
        return 0

    return asyncio.run(run())


def cmd_stats(args) -> int:
    from services.tools.stats_view import show
    address = args.router or load_config(args.config).router.address
    return show(address, args.watch, args.api_key, args.tls_ca)


def cmd_alerts(args) -> int:
    config = load_config(args.config)
    if args.rules:
        from services.control.alert_rules import rules_yaml
        print(rules_yaml(config, kubernetes=args.kubernetes), end="")
        return 0
    from services.tools.alerts_view import show
    return show(args.router or config.router.address, args.api_key, args.tls_ca)


def cmd_bench(args) -> int:
    """Run bench/qos_burst.py (in the source checkout, beside services/) with the remaining arguments."""
    import runpy

    from services.common.paths import source_checkout
    root = source_checkout()
    if root is None:
        raise FileNotFoundError(
            f"installed in {Path(__file__).resolve().parents[2]}, not a source checkout, and the benchmark "
            "is bench/qos_burst.py of the repository: run it from a clone set up with `make venv` "
            "(or `pip install -e .`)")
    script = root / "bench" / "qos_burst.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} is missing from this checkout")
    sys.argv = [str(script), *args.bench_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_demo(args) -> int:
    from services.tools.demo import run_demo
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qos-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start router, scheduler and workers; Ctrl-C stops them")
    _config_args(p)
    p.add_argument("--autoscale", action="store_true",
                   help="start and drain extra CPU workers as each pool's desired_workers asks, within "
                        "[pools.autoscale] min_workers..max_workers")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("generate", help="stream one answer through the router")
    _config_args(p)
    p.add_argument("prompt")
    p.add_argument("--router", help="router address (default: from --config, else 127.0.0.1:50051)")
    p.add_argument("--priority", choices=LABELS)
    p.add_argument("--tenant")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--file", metavar="PATH", help="append this file's text to the prompt (-: standard input)")
    p.add_argument("--context-mode", choices=["auto", "dense", "streaming"],
                   help="attention for prompts longer than the context (x-context-mode; default auto)")
    _client_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("stats", help="the cluster per priority: latency percentiles, queues, KV, weights")
    _config_args(p)
    p.add_argument("--router", help="router address (default: from --config, else 127.0.0.1:50051)")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh in place every SECONDS (default 2)")
    _client_args(p)
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("alerts", help="the SLA objectives now, open and recent alerts (Router.Alerts)")
    _config_args(p)
    p.add_argument("--router", help="router address (default: from --config, else 127.0.0.1:50051)")
    p.add_argument("--rules", action="store_true",
                   help="print the Prometheus alerting rules equivalent to the config's [[sla]] contracts")
    p.add_argument("--kubernetes", action="store_true",
                   help="with --rules: as a Prometheus Operator PrometheusRule object")
    _client_args(p)
    p.set_defaults(func=cmd_alerts)

    p = sub.add_parser("bench", help="the QoS burst benchmark (FCFS vs QoS); see bench/qos_burst.py -h",
                       add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench)

    from services.tools.admin_cli import add_parsers
    add_parsers(sub, _config_args)

    p = sub.add_parser("drain", help="drain a worker (no new sequences, finish, leave), as SIGTERM does")
    p.add_argument("kind", choices=["worker"])
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--wait", type=float, nargs="?", const=120.0, default=0.0, metavar="SECONDS",
                   help="wait until it has left (default 120 s)")
    p.add_argument("--config", help="the cluster's config: its [security] token and certificates "
                                    "(default: $QOS_CLUSTER_TOKEN only)")
    p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_drain)

    from services.tools.trust_cli import add_parsers as add_trust_parsers
    add_trust_parsers(sub)

    p = sub.add_parser("demo", help="a local cluster serving a mixed-priority burst, with a report")
    _config_args(p)
    p.add_argument("--requests-per-priority", type=int, default=6)
    p.add_argument("--policy", choices=["qos", "fcfs"], default="qos",
                   help="scheduling policy of the demo cluster (fcfs: the baseline to compare)")
    p.set_defaults(func=cmd_demo)

    for name, func, text in [("router", cmd_router, "run the router"),
                             ("scheduler", cmd_scheduler, "run a pool's scheduler"),
                             ("worker", cmd_worker, "run one worker")]:
        p = sub.add_parser(name, help=text)
        _config_args(p)
        p.add_argument("--listen", metavar="HOST",
                       help="address to bind (e.g. 0.0.0.0 in a container); the config's host "
                            "stays the address the others connect to")
        if name in ("worker", "scheduler"):
            p.add_argument("--pool", help="which pool (default: the first)")
        if name == "router":
            p.add_argument("--port", type=int, help="gRPC port instead of the configured one (a second replica)")
            p.add_argument("--http-port", type=int, help="HTTP port instead of the configured one (-1: off)")
            p.add_argument("--metrics-port", type=int, help="/metrics port instead of the configured one")
        if name == "worker":
            p.add_argument("--index", type=int, default=0, help="which of the pool's workers to run")
            p.add_argument("--port", type=int, help="serve on this port instead of the configured one "
                                                    "(0: a free one)")
            p.add_argument("--join", metavar="SCHEDULER", help="register with this scheduler (HOST:PORT) "
                                                               "and keep registering: join its pool at run time")
            p.add_argument("--advertise", metavar="HOST:PORT",
                           help="the address the scheduler reaches this worker at (default: the "
                                "configured host and the port)")
            p.add_argument("--device", help="cpu, cuda[:N] or npu[:N] (default: the worker's config; "
                                            "a bare kind keeps the configured index)")
        p.set_defaults(func=func)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    # `bench` hands every flag on to bench/qos_burst.py; argparse's REMAINDER alone does not take
    # flags that come first (`qos-serve bench --scale 0.1`), so collect the unknown ones here.
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "bench":
        args.bench_args = unknown + args.bench_args
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    try:
        sys.exit(args.func(args))
    except (ConfigError, FileNotFoundError) as exc:
        print(f"qos-serve {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)
    except ValueError as exc:        # StoreError and bad option values: say which, exit 2
        if type(exc).__name__ not in ("StoreError", "ValueError"):
            raise
        print(f"qos-serve {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as exc:
        from services.engine.device import DeviceUnavailableError
        if not isinstance(exc, DeviceUnavailableError):
            raise
        print(f"qos-serve {args.command}: {exc}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
