"""The benchmarks: scripts run as `python bench/NAME.py` (or `qos-serve bench` for qos_burst.py),
plus the modules they share. A package so that those modules import as `bench.harness`,
`bench.loadgen`... from the repository root, which every script puts on sys.path first, and so
that the load generator's spawned client processes find `bench.loadgen._client_main` again.
Not installed with `services` (pyproject.toml packages only services*): it runs from a checkout.
"""
