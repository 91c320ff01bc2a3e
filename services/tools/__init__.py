"""What a person runs: the `qos-serve` command and its subcommands (up, demo, stats, alerts,
admin, healthcheck) and the Python client they use."""
