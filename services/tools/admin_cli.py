"""The operator's commands on the tenant and billing store ([store] url of --config, else
$QOS_STORE_URL, else SQLite in the cache folder). They talk to the database directly; routers pick
changes up within seconds (services/control/tenancy.py).

    qos-serve tenants add NAME [--priorities high,medium,low] [--rpm N] [--tpm N]
                               [--max-concurrent N] [--budget UNITS] [--weight W] [--storage-mb MB]
    qos-serve tenants set NAME [the same options] [--clear rpm,tpm,...]
    qos-serve tenants list
    qos-serve keys create TENANT        prints the key once: only its hash is stored
    qos-serve keys revoke PREFIX
    qos-serve keys list
    qos-serve billing report [--tenant T] [--since YYYY-MM-DD] [--by tenant|day|priority|pool|model] [--csv]

Each takes --config FILE before or after its action.
"""
from __future__ import annotations

import argparse
import sys
import time

LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "budget", "storage_mb")


def _store(args):
    from services.common.config_file import load_config
    from services.store.store import Store
    url = load_config(args.config).store.url if args.config else None
    return Store(url or None)


def _limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--priorities", help="classes it may use, e.g. medium,low (default: all)")
    p.add_argument("--rpm", type=int, help="requests per minute")
    p.add_argument("--tpm", type=int, help="tokens per minute (prompt + max_tokens)")
    p.add_argument("--max-concurrent", type=int, help="streams open at once")
    p.add_argument("--budget", type=float, help="cost units it may spend, all time")
    p.add_argument("--weight", type=float, help="its share inside a priority class (default 1)")
    p.add_argument("--storage-mb", type=int, help="MB of files, kept responses and conversations it may keep "
                   "(default: [store] tenant_storage_mb; 0: none)")


def _fields(args) -> dict:
    return {"priorities": tuple(args.priorities.split(",")) if args.priorities else None, "rpm": args.rpm,
            "tpm": args.tpm, "max_concurrent": args.max_concurrent, "budget": args.budget,
            "weight": args.weight, "storage_mb": args.storage_mb}


def _show(tenant) -> str:
    def limit(value):
        return "-" if value is None else f"{value:g}"
    return (f"{tenant.name:<20} {','.join(tenant.priorities):<18} {limit(tenant.rpm):>6} {limit(tenant.tpm):>8} "
            f"{limit(tenant.max_concurrent):>6} {limit(tenant.budget):>10} {tenant.weight:>6g} "
            f"{limit(tenant.storage_mb):>10}")


def cmd_tenants(args) -> int:
    from services.store.store import Tenant
    store = _store(args)
    if args.action == "add":
        fields = {k: v for k, v in _fields(args).items() if v is not None}
        print(_show(store.add_tenant(Tenant(args.name, **fields))))
    elif args.action == "set":
        clear = [c.strip().replace("-", "_") for c in (args.clear or "").split(",") if c.strip()]
        unknown = [c for c in clear if c not in LIMIT_FIELDS]
        if unknown:
            raise ValueError(f"--clear takes {', '.join(LIMIT_FIELDS)}, got {', '.join(unknown)}")
        print(_show(store.set_tenant(args.name, clear=clear, **_fields(args))))
    else:
        print(f"{'tenant':<20} {'priorities':<18} {'rpm':>6} {'tpm':>8} {'conc.':>6} {'budget':>10} {'weight':>6} "
              f"{'storage MB':>10}")
        for tenant in store.tenants():
            print(_show(tenant))
    return 0


def cmd_keys(args) -> int:
    store = _store(args)
    if args.action == "create":
        key, prefix = store.create_key(args.tenant)
        print(key)
        print(f"key {prefix}… for tenant {args.tenant}: shown this once, only its hash is stored",
              file=sys.stderr)
    elif args.action == "revoke":
        print(f"revoked {args.prefix} (tenant {store.revoke_key(args.prefix)})")
    else:
        for prefix, tenant, created, revoked in store.keys():
            state = f"revoked {time.strftime('%Y-%m-%d %H:%M', time.gmtime(revoked))}" if revoked else "active"
            print(f"{prefix}…  {tenant:<20} created {time.strftime('%Y-%m-%d %H:%M', time.gmtime(created))}  {state}")
    return 0


def cmd_billing(args) -> int:
    from services.store.billing import parse_since, render, report
    store = _store(args)
    rows = store.ledger_rows(tenant=args.tenant, since=parse_since(args.since))
    lines, total = report(rows, args.by)
    sys.stdout.write(render(lines, total, args.by, as_csv=args.csv))
    return 0


def add_parsers(sub, config_args) -> None:
    """tenants, keys and billing; --config and --log-level go before or after the action
    (`tenants --config F add acme` and `tenants add acme --config F`)."""
    def action(actions, name: str) -> argparse.ArgumentParser:
        a = actions.add_parser(name)
        config_args(a, nested=True)
        return a

    p = sub.add_parser("tenants", help="add, change or list tenants (limits, priorities, budget, weight)")
    config_args(p)
    actions = p.add_subparsers(dest="action", required=True)
    for name in ("add", "set"):
        a = action(actions, name)
        a.add_argument("name")
        _limits(a)
        if name == "set":
            a.add_argument("--clear", metavar="FIELDS", help="set these back to no limit (storage_mb: to the "
                           "[store] default): rpm,tpm,max_concurrent,budget,storage_mb")
    action(actions, "list")
    p.set_defaults(func=cmd_tenants)

    p = sub.add_parser("keys", help="create, revoke or list API keys")
    config_args(p)
    actions = p.add_subparsers(dest="action", required=True)
    action(actions, "create").add_argument("tenant")
    action(actions, "revoke").add_argument("prefix")
    action(actions, "list")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("billing", help="the bill, from the ledger")
    config_args(p)
    actions = p.add_subparsers(dest="action", required=True)
    r = action(actions, "report")
    r.add_argument("--tenant")
    r.add_argument("--since", help="YYYY-MM-DD (UTC) or unix seconds")
    r.add_argument("--by", default="tenant", choices=["tenant", "day", "priority", "pool", "model"])
    r.add_argument("--csv", action="store_true")
    p.set_defaults(func=cmd_billing)
