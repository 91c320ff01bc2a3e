"""The command line's parsing: `bench` passes every flag on to the benchmark script; other
commands refuse flags they do not know; service commands take --listen and the worker --device."""
from __future__ import annotations

import pytest

from services.cli import parse_args


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
