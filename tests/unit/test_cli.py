"""The command line's parsing: `bench` passes every flag on to the benchmark script; other
commands refuse flags they do not know; service commands take --listen and the worker --device."""
from __future__ import annotations

import pytest

from services.tools.cli import parse_args


@pytest.mark.parametrize("argv, passed_on", [
    (["bench", "--scale", "0.1", "--policies", "qos"], ["--scale", "0.1", "--policies", "qos"]),
    (["bench", "--trace", "azure-code"], ["--trace", "azure-code"]),
    (["bench"], []),
])
def test_bench_passes_every_flag_to_the_script(argv, passed_on):
    assert sorted(parse_args(argv).bench_args) == sorted(passed_on)


def test_other_commands_refuse_unknown_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(["generate", "hello", "--scale", "2"])
    assert "unrecognized arguments: --scale 2" in capsys.readouterr().err


def test_service_flags():
    args = parse_args(["worker", "--config", "c.toml", "--pool", "gpu", "--device", "cuda:1",
                       "--listen", "0.0.0.0"])
    assert (args.pool, args.device, args.listen) == ("gpu", "cuda:1", "0.0.0.0")
    assert parse_args(["router", "--listen", "0.0.0.0"]).listen == "0.0.0.0"


def test_cluster_ports_left_to_the_system_are_all_different(monkeypatch):
    """bind(0) may hand out a port it handed out a moment ago; no two services may get it."""
    from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool
    from services.local import cluster
    handed_out = iter([5001, 5001, 5002, 5001, 5003, 5004, 5004, 5005, 5006, 5007, 5008, 5009])
    monkeypatch.setattr(cluster, "free_port", lambda host="127.0.0.1": next(handed_out))
    config = cluster.resolve_ports(single_pool(
        router=RouterConfig(port=0, http_port=0, metrics_port=0), scheduler=SchedulerConfig(port=0, metrics_port=0),
        workers=[WorkerConfig(port=0, metrics_port=0)]))
    sections = [config.router, config.pools[0].scheduler, config.pools[0].workers[0]]
    ports = [p for s in sections for p in (s.port, s.metrics_port)] + [config.router.http_port]
    assert len(set(ports)) == len(ports) == 7 and min(ports) >= 5001

