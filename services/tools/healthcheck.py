"""python -m services.tools.healthcheck HOST:PORT [--service NAME] [--timeout SECONDS] [--certs DIR --role ROLE]

One grpc.health.v1 Check against a qos-serve service, for container healthchecks: prints one line
and exits 0 only when the answer is SERVING; 1 for NOT_SERVING, an unknown service, nothing
listening or no answer in time. Imports grpc only, never torch, so it stays cheap in every image.
With the cluster's mutual TLS, `--certs DIR --role ROLE` presents ROLE's certificate and expects
the server to be a ROLE (a container checking itself); health checks need no cluster token.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.cluster_auth import ROLES, ClusterTrust


def check(address: str, service: str = "", timeout: float = 3.0, certs: str = "",
          role: str = "worker") -> tuple[bool, str]:
    """(serving, one-line message) for `service` ("" = the whole server) at `address`."""
    label = f"{address} {service!r}" if service else address
    trust = ClusterTrust(role, certs_dir=Path(certs)) if certs else ClusterTrust(role)
    with trust.sync_channel(address, role) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{label}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{label}: {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.tools.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("--service", default="", help="service name to check (default: the server)")
    parser.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS")
    parser.add_argument("--certs", default="", metavar="DIR", help="the cluster's certificates (mutual TLS)")
    parser.add_argument("--role", default="worker", choices=ROLES, help="with --certs: whose certificate to "
                        "present, and what the server must be")
    args = parser.parse_args(argv)
    serving, message = check(args.address, args.service, args.timeout, args.certs, args.role)
    print(message, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
