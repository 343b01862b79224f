"""Placement on hosts: spec rules for hosts, demand per host, and the check against Ray's nodes (no Ray)."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.placement import (
    ROUTER_SHARE,
    PlacementError,
    RayNode,
    actor_resources,
    advertised,
    host_demand,
    host_resource,
    plan_placement,
)
from config import ClusterSpec
from config.errors import ConfigError


def three_host_spec(**placement: Any) -> ClusterSpec:
    def node(name: str, host: str | None, role: str, replicas: int = 1) -> dict[str, Any]:
        return {"name": name, "region": "local", "hardware": "h100-80g-sxm", "gpus": 2, "host": host,
                "engines": [{"name": f"{name}-e", "role": role, "model": "lesson-70b-fp8", "replicas": replicas}]}

    return ClusterSpec.model_validate({
        "name": "three",
        "nodes": [node("np", "host1", "prefill"), node("nd", "host2", "decode", replicas=2)],
        "placement": {"hosts": [{"name": "host1"}, {"name": "host2"}, {"name": "host3"}],
                      "router_host": "host3", **placement}})


def nodes(**offers: float) -> list[RayNode]:
    return [RayNode(f"id{i}", f"10.0.0.{i + 2}", True, {"CPU": 1.0, host_resource(h): v})
            for i, (h, v) in enumerate(offers.items())]


def test_demand_counts_each_hosts_gpus_and_the_router_share() -> None:
    assert host_demand(three_host_spec()) == {"host1": 1.0, "host2": 2.0, "host3": ROUTER_SHARE}


def test_plan_maps_hosts_to_their_node_and_binds_the_node_address_when_spanning_hosts() -> None:
    p = plan_placement(three_host_spec(), nodes(host1=8, host2=8, host3=8))
    assert dict(p.addresses) == {"host1": "10.0.0.2", "host2": "10.0.0.3", "host3": "10.0.0.4"}
    assert p.bind_for("host2") == "10.0.0.3"
    assert actor_resources("host2", 2) == {"resources": {"kvmesh_host:host2": 2}}
    assert actor_resources(None, 2) == {}


def test_bind_host_given_is_used_everywhere() -> None:
    p = plan_placement(three_host_spec(bind_host="0.0.0.0"), nodes(host1=8, host2=8, host3=8))
    assert {p.bind_for(h) for h in ("host1", "host2", "host3")} == {"0.0.0.0"}


def test_one_host_binds_loopback() -> None:
    spec = ClusterSpec.model_validate({
        "name": "one", "nodes": [{"name": "n", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1,
                                  "engines": [{"name": "e", "model": "lesson-70b-fp8"}]}]})
    p = plan_placement(spec, nodes(anything=1))
    assert p.bind_for(None) == "127.0.0.1" and not p.addresses


def test_several_nodes_without_hosts_is_refused_not_left_to_luck() -> None:
    spec = ClusterSpec.model_validate({
        "name": "one", "nodes": [{"name": "n", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1,
                                  "engines": [{"name": "e", "model": "lesson-70b-fp8"}]}]})
    with pytest.raises(PlacementError, match=r"2 nodes but the spec declares no placement\.hosts"):
        plan_placement(spec, nodes(a=1, b=1))


def test_missing_and_short_hosts_are_all_named_before_anything_starts() -> None:
    with pytest.raises(PlacementError) as e:
        plan_placement(three_host_spec(), nodes(host1=8, host2=1))
    msg = str(e.value)
    assert "host 'host2': the spec needs 2 of 'kvmesh_host:host2' (emulated GPUs) but node 10.0.0.3 offers 1" in msg
    assert "host 'host3': no alive Ray node has resource 'kvmesh_host:host3'" in msg
    assert "hosts the cluster has: host1, host2" in msg


def test_a_dead_node_does_not_count() -> None:
    ns = nodes(host1=8, host2=8, host3=8)
    ns[2] = RayNode("id2", "10.0.0.4", False, ns[2].resources)
    with pytest.raises(PlacementError, match="host 'host3': no alive Ray node"):
        plan_placement(three_host_spec(), ns)


@pytest.mark.parametrize(("change", "field"), [
    ({"router_host": None}, "placement.router_host"),
    ({"router_host": "elsewhere"}, "placement.router_host"),
    ({"hosts": [{"name": "host1"}, {"name": "host1"}, {"name": "host3"}]}, "placement.hosts"),
    ({"bind_host": "my-laptop"}, "placement.bind_host"),
])
def test_spec_rules_for_hosts_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=field.replace(".", r"\.")):
        three_host_spec(**change)


def test_every_node_must_name_a_declared_host_in_its_region() -> None:
    base = three_host_spec().model_dump()
    base["nodes"][0]["host"] = None
    with pytest.raises(ValueError, match=r"nodes\[0\]\.host"):
        ClusterSpec.model_validate(base)
    base["nodes"][0]["host"] = "host9"
    with pytest.raises(ValueError, match="'host9' is not declared"):
        ClusterSpec.model_validate(base)
    base["nodes"][0]["host"] = "host1"
    base["placement"]["hosts"][0]["region"] = "us-east-1"
    base["regions"] = [{"name": "local"}, {"name": "us-east-1"}]
    base["nodes"][1]["region"] = "us-east-1"
    with pytest.raises(ValueError, match=r"nodes\[0\]\.region"):
        ClusterSpec.model_validate(base)


def test_a_wildcard_bind_is_advertised_as_the_nodes_address() -> None:
    meta = {"url": "http://0.0.0.0:4000/e/p", "feed_url": "http://0.0.0.0:4000",
            "kv_address": {"backend": "tcp", "location": "0.0.0.0:5000", "node": "n", "region": "r"}}
    out = advertised(meta, "0.0.0.0", "10.0.0.3")
    assert out["url"] == "http://10.0.0.3:4000/e/p" and out["feed_url"] == "http://10.0.0.3:4000"
    assert out["kv_address"]["location"] == "10.0.0.3:5000" and meta["url"] == "http://0.0.0.0:4000/e/p"
    assert advertised(meta | {"url": "http://10.0.0.9:1/x"}, "10.0.0.9", "10.0.0.3")["url"] == "http://10.0.0.9:1/x"
    p = plan_placement(three_host_spec(bind_host="0.0.0.0"), nodes(host1=8, host2=8, host3=8))
    assert p.address_for("host3") == "10.0.0.4" and p.address_for(None) == "127.0.0.1"


def labelled(**regions: str | None) -> list[RayNode]:
    """One node per host offering 8 GPUs, labelled with its region (no label for None)."""
    return [RayNode(f"id{i}", f"10.0.0.{i + 2}", True, {host_resource(h): 8.0},
                    {} if r is None else {"ray.io/availability-region": r})
            for i, (h, r) in enumerate(regions.items())]


def regional_spec() -> ClusterSpec:
    spec = three_host_spec()
    hosts = [{"name": "host1", "region": "local"}, {"name": "host2", "region": "local"}, {"name": "host3"}]
    return ClusterSpec.model_validate({**spec.model_dump(), "placement": {**spec.placement.model_dump(),
                                                                          "hosts": hosts}})


def test_a_host_on_a_node_labelled_with_another_region_fails_naming_both() -> None:
    with pytest.raises(PlacementError) as e:
        plan_placement(regional_spec(), labelled(host1="local", host2="eu-west-1", host3="anything"))
    msg = str(e.value)
    assert ("host 'host2': the spec puts it in region 'local' but its Ray node 10.0.0.3 is labelled "
            "ray.io/availability-region=eu-west-1") in msg
    assert "host1" not in msg.split("hosts the cluster has")[0]  # host1 agrees; host3 declares no region


def test_region_labels_that_agree_pass_and_unlabelled_nodes_are_reported_unchecked() -> None:
    p = plan_placement(regional_spec(), labelled(host1="local", host2=None, host3="x"))
    assert p.unchecked_regions == ("host2",)
    custom = [RayNode("a", "10.0.0.2", True, {host_resource("host1"): 8.0}, {"region": "local"}),
              RayNode("b", "10.0.0.3", True, {host_resource("host2"): 8.0}, {"region": "local"}),
              RayNode("c", "10.0.0.4", True, {host_resource("host3"): 8.0})]
    assert plan_placement(regional_spec(), custom).unchecked_regions == ()
    standard_first = RayNode("b", "10.0.0.3", True, {host_resource("host2"): 8.0},
                             {"ray.io/availability-region": "us", "region": "local"})
    with pytest.raises(PlacementError, match=r"labelled ray\.io/availability-region=us"):
        plan_placement(regional_spec(), [custom[0], standard_first, custom[2]])
