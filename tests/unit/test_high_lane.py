"""The router's High lane (services/router/high_lane.py): its class rule, its port in the config,
and the load generator sending High there."""
from __future__ import annotations

import pytest

from bench.loadgen import Front
from services.common.config import ConfigError, RouterConfig, single_pool
from services.common.config_file import parse_config
from services.common.errors import ErrorKind, ServiceError
from services.local.cluster import resolve_ports
from services.router.high_lane import lane_metadata
from services.router.validation import parse_head

ROUTER = RouterConfig(port=50051, high_port=50061)


def test_a_lane_call_without_a_class_is_high_and_a_high_one_passes():
    assert lane_metadata({"x-tenant": "acme"}, ROUTER) == {"x-tenant": "acme", "x-priority": "high"}
    assert lane_metadata({"x-priority": "HIGH"}, ROUTER) == {"x-priority": "HIGH"}
    assert parse_head(lane_metadata({}, ROUTER)).priority.label == "high"


@pytest.mark.parametrize("value", ["medium", "low"])
def test_another_class_on_the_lane_is_refused_naming_the_main_port(value):
    with pytest.raises(ServiceError) as refused:
        lane_metadata({"x-priority": value}, ROUTER)
    assert refused.value.kind == ErrorKind.INVALID and refused.value.field == "x-priority"
    assert str(refused.value) == (f"router.high_port 50061 takes high-priority requests only, got x-priority: "
                                  f"{value}; send it to the router's port 50051")


def test_a_bad_class_on_the_lane_gets_the_main_ports_message():
    metadata = lane_metadata({"x-priority": "urgent"}, ROUTER)      # parse_head refuses it, as anywhere
    with pytest.raises(ServiceError, match="invalid x-priority 'urgent': use high, medium or low"):
        parse_head(metadata)


def test_the_lane_is_off_unless_a_port_is_given():
    assert parse_config({}).router.high_port == -1 and parse_config({}).router.high_address is None
    router = parse_config({"router": {"high_port": 50061}}).router
    assert router.high_address == "127.0.0.1:50061"


@pytest.mark.parametrize("router, message", [
    ({"high_port": -2}, r"router\.high_port must be in 0\.\.65535 \(0 = a free port\) or -1 \(off\), got -2"),
    ({"high_port": True}, r"router\.high_port must be int, got True"),
    ({"port": 50051, "high_port": 50051}, r"router\.high_port 50051 is the router's gRPC port too"),
    ({"http_port": 8000, "high_port": 8000}, r"router\.high_port 8000 is the router's HTTP port too"),
])
def test_bad_lane_ports_are_refused_naming_the_key(router, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"router": router})


def test_a_local_cluster_gives_the_lane_a_free_port_of_its_own():
    config = resolve_ports(single_pool(router=RouterConfig(port=0, http_port=0, high_port=0)))
    router = config.router
    assert router.high_port > 0 and len({router.port, router.http_port, router.high_port}) == 3


def test_the_load_generator_sends_high_to_the_lane_and_the_rest_to_the_main_port():
    front = Front("grpc", "127.0.0.1:50051", high_address="127.0.0.1:50061")
    assert front.for_priority("high").address == "127.0.0.1:50061"
    assert front.for_priority("low").address == front.for_priority("medium").address == "127.0.0.1:50051"
    assert Front("grpc", "127.0.0.1:50051").for_priority("high").address == "127.0.0.1:50051"   # no lane
