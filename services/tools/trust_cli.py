"""`qos-serve certs init DIR` and `qos-serve tokens init|env DIR`: each role's credentials for the
internal hops (services/common/cluster_auth.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

from services.common.config import ConfigError


def cmd_certs_init(args) -> int:
    from services.tools.certs import init
    if args.days < 1:
        raise ConfigError(f"--days must be at least 1, got {args.days}")
    try:
        written = init(Path(args.dir), args.days, tuple(args.host), args.force,
                       ca_dir=Path(args.ca_dir) if args.ca_dir else None)
    except (FileExistsError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    print(f"wrote {len(written) - 1} files in {args.dir}: {', '.join(p.name for p in written[:-1])}; valid "
          f"for {args.days} days. Point [security] certs_dir at it. The CA's key is {written[-1]}: keep it "
          f"off the services' machines.")
    return 0


def cmd_tokens_init(args) -> int:
    from services.tools.tokens import init
    try:
        written = init(Path(args.dir), args.force)
    except FileExistsError as exc:
        raise ConfigError(str(exc)) from exc
    print(f"wrote {len(written)} files in {args.dir}: {', '.join(p.name for p in written)}. Point "
          f"[security] tokens_dir at it and give each service only its own ROLE.token and roles.")
    return 0


def cmd_tokens_env(args) -> int:
    from services.tools.tokens import env
    try:
        print(env(Path(args.dir)), end="")
    except OSError as exc:
        raise ConfigError(f"{args.dir}: {exc.strerror}: {exc.filename} (`qos-serve tokens init {args.dir}` "
                          f"makes the files)") from exc
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("certs", help="certificates for mutual TLS inside the cluster")
    certs = p.add_subparsers(dest="certs_command", required=True)
    p = certs.add_parser("init", help="a development CA and a certificate for each role in DIR")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--days", type=int, default=365, help="validity (default 365)")
    p.add_argument("--host", action="append", default=[], metavar="NAME",
                   help="another DNS name or IP address every certificate is valid for (repeatable)")
    p.add_argument("--force", action="store_true", help="replace an existing CA")
    p.add_argument("--ca-dir", metavar="DIR", help="where the CA's private key goes (default: DIR-ca, "
                                                   "beside DIR; never inside it)")
    p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_certs_init)

    p = sub.add_parser("tokens", help="a token for each role of the cluster (the internal hops)")
    tokens = p.add_subparsers(dest="tokens_command", required=True)
    p = tokens.add_parser("init", help="a token for each role and their digests in DIR")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--force", action="store_true", help="replace existing tokens")
    p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_tokens_init)
    p = tokens.add_parser("env", help="DIR's tokens as shell exports (for docker compose)")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_tokens_env)
