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



def test_router_replicas_get_their_own_ports_and_the_same_config(monkeypatch):
    """[auth] replicas = 3: two more routers, each on ports of its own, none clashing with the configured ones."""
    from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool
    from services.local import cluster
    handed_out = iter([50051, 7001, 7002, 7003, 8000, 7004, 7005, 7006])
    monkeypatch.setattr(cluster, "free_port", lambda host="127.0.0.1": next(handed_out))
    config = single_pool(router=RouterConfig(port=50051, http_port=8000, metrics_port=9091),
                         scheduler=SchedulerConfig(port=50052), workers=[WorkerConfig(port=50053)])
    config.auth.replicas = 3
    replicas = cluster.router_replicas(config)
    assert [r.name for r in replicas] == ["router-2", "router-3"]
    ports = [p for r in replicas for p in (r.port, r.http_port, r.metrics_port)]
    assert ports == [7001, 7002, 7003, 7004, 7005, 7006]       # 50051 and 8000 were taken: skipped
    assert replicas[0].args() == ("router", "--port", "7001", "--http-port", "7002", "--metrics-port", "7003")
    assert cluster.router_replicas(single_pool()) == []


@pytest.mark.parametrize("argv", [
    ["tenants", "add", "acme", "--config", "c.toml"],
    ["tenants", "--config", "c.toml", "add", "acme"],
    ["keys", "list", "--config", "c.toml"],
    ["billing", "report", "--by", "day", "--config", "c.toml"],
    ["drain", "worker", "127.0.0.1:50053", "--config", "c.toml"],
    ["alerts", "--rules", "--config", "c.toml"],
])
def test_config_goes_before_or_after_the_action(argv):
    assert parse_args(argv).config == "c.toml"
    assert parse_args(["tenants", "--log-level", "DEBUG", "add", "acme"]).log_level == "DEBUG"
    assert parse_args(["tenants", "add", "acme"]).config is None


def test_tenants_add_with_config_after_the_action_uses_its_store(tmp_path, capsys):
    from services.store.store import Store
    from services.tools.cli import main
    url = f"sqlite:///{tmp_path}/store.db"
    (tmp_path / "c.toml").write_text(f'[store]\nurl = "{url}"\n')
    with pytest.raises(SystemExit) as exit:
        main(["tenants", "add", "acme", "--rpm", "60", "--config", str(tmp_path / "c.toml")])
    assert exit.value.code == 0, capsys.readouterr().err
    assert [(t.name, t.rpm) for t in Store(url).tenants()] == [("acme", 60)]


def test_bench_finds_its_script_from_any_folder(tmp_path, monkeypatch, capsys):
    from services.tools.cli import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["qos-serve"])
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--help"])
    assert exit.value.code == 0 and "usage: qos_burst.py" in capsys.readouterr().out


def test_bench_without_the_source_tree_says_so(monkeypatch, capsys):
    from services.common import paths
    from services.tools.cli import main
    monkeypatch.setattr(paths, "source_checkout", lambda: None)
    with pytest.raises(SystemExit) as exit:
        main(["bench"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "not a source checkout" in err and "bench/qos_burst.py" in err
