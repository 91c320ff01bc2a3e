"""python -m services.tools.healthcheck HOST:PORT [--service NAME] [--timeout SECONDS]

One grpc.health.v1 Check against a qos-serve service, for container healthchecks: prints one line
and exits 0 only when the answer is SERVING; 1 for NOT_SERVING, an unknown service, nothing
listening or no answer in time. Imports grpc only, never torch, so it stays cheap in every image.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(serving, one-line message) for `service` ("" = the whole server) at `address`."""
    label = f"{address} {service!r}" if service else address
    with grpc.insecure_channel(address) as channel:
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
    args = parser.parse_args(argv)
    serving, message = check(args.address, args.service, args.timeout)
    print(message, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
