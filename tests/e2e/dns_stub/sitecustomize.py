"""A test resolver for service processes: with $QOS_TEST_DNS_FILE set (JSON {"name": ["ip", ...]}),
socket.getaddrinfo answers those names from the file, read at every lookup, so a test can add and
remove a "headless Service"'s addresses while the processes run. Loaded by Python at start-up
when this folder is on PYTHONPATH (tests/e2e/test_kubernetes_membership.py); every other name
resolves as usual."""
import json
import os
import socket

_real_getaddrinfo = socket.getaddrinfo


def _stub_getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
    path = os.environ.get("QOS_TEST_DNS_FILE")
    if path and isinstance(host, str):
        try:
            with open(path) as file:
                names = json.load(file)
        except (OSError, ValueError):
            names = {}
        if host in names:
            if not names[host]:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, int(port)))
                    for ip in names[host]]
    return _real_getaddrinfo(host, port, family, type, proto, flags)


socket.getaddrinfo = _stub_getaddrinfo
