"""Disaggregated prefill and decode on a real Ray cluster: KV over real sockets, push and pull, fallbacks."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.launch import ClusterHandle, launch
from config import ClusterSpec


def pd_spec(name: str, hand_off: str, decode_blocks: int | None = None, **extra: Any) -> ClusterSpec:
    decode: dict[str, Any] = {"name": "d", "role": "decode", "model": "lesson-70b-fp8"}
    if decode_blocks:
        decode["scheduler"] = {"num_gpu_blocks": decode_blocks}
    return ClusterSpec.model_validate({
        "name": name,
        "nodes": [{"name": "np", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1, "nic": "lesson-rdma",
                   "engines": [{"name": "p", "role": "prefill", "model": "lesson-70b-fp8"}]},
                  {"name": "nd", "region": "local", "hardware": "h100-80g-sxm", "gpus": 1, "nic": "lesson-rdma",
                   "engines": [decode]}],
        "transport": {"backend": "tcp", "kv_payload_scale": 1 / 256, **extra.pop("transport", {})},
        "disagg": {"hand_off": hand_off, **extra.pop("disagg", {})},
        "router": {"policy": "least_loaded"}, **extra})


@pytest.fixture(scope="module")
def push_cluster(ray_cluster: object) -> Iterator[ClusterHandle]:
    h = launch(pd_spec("pd-push", "push", decode_blocks=400))
    try:
        yield h
    finally:
        h.shutdown()


async def stream(url: str, body: dict[str, Any], path: str = "/v1/completions") -> tuple[dict[str, str], list[Any]]:
    events: list[Any] = []
    async with aiohttp.ClientSession() as s, s.post(url + path, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append("DONE" if line.strip() == b"data: [DONE]" else json.loads(line[6:]))
        return dict(r.headers), events


def tokens_of(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c.get("token_ids", [])]


def metric(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def assert_blocks_back(h: ClusterHandle) -> None:
    assert h.blocks_returned(), f"blocks not returned: {h.load()}"


def prompt(n: int, base: int) -> list[int]:
    """Distinct prompts for distinct bases, inside the 32,000-token vocabulary of the lesson profile."""
    return [16 + (base * 7 + i) % 31_000 for i in range(n)]


def test_push_hand_off_streams_every_token_through_one_stream(push_cluster: ClusterHandle) -> None:
    h = push_cluster
    headers, events = asyncio.run(stream(h.router_url, {"prompt": prompt(3000, 1000), "max_tokens": 40,
                                                        "ignore_eos": True, "stream_options": {"include_usage": True}}))
    assert headers["X-Served-By"] == "d"
    toks = tokens_of(events)
    assert len(toks) == 40
    content = [e for e in events if isinstance(e, dict) and e.get("choices")]
    assert len({e["id"] for e in content}) == 1
    assert [c["choices"][0]["finish_reason"] for c in content if c["choices"][0]["finish_reason"]] == ["length"]
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert len(usage) == 1
    assert (usage[0]["prompt_tokens"], usage[0]["completion_tokens"], usage[0]["total_tokens"]) == (3000, 40, 3040)
    assert events[-1] == "DONE" and events.count("DONE") == 1
    assert metric(h.router_url, "kvmesh_router_disagg_decisions_total", reason="disaggregated") >= 1
    assert metric(h.engine_urls["p"], "kvmesh:kv_transfers_total", op="push", outcome="ok") >= 1
    assert_blocks_back(h)


def test_short_prompts_are_served_on_the_decode_engine_alone(push_cluster: ClusterHandle) -> None:
    h = push_cluster
    before = metric(h.router_url, "kvmesh_router_disagg_decisions_total", reason="short_uncached")
    headers, events = asyncio.run(stream(h.router_url, {"prompt": prompt(200, 90000), "max_tokens": 5,
                                                        "ignore_eos": True}))
    assert headers["X-Served-By"] == "d" and len(tokens_of(events)) == 5
    assert metric(h.router_url, "kvmesh_router_disagg_decisions_total", reason="short_uncached") == before + 1


def test_chat_and_non_streaming_requests_through_prefill_and_decode(push_cluster: ClusterHandle) -> None:
    h = push_cluster
    _, events = asyncio.run(stream(h.router_url, {"messages": [{"role": "user", "content": "word " * 1200}],
                                                  "max_tokens": 8, "ignore_eos": True}, "/v1/chat/completions"))
    first = next(e for e in events if isinstance(e, dict))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["object"] == "chat.completion.chunk" and len(tokens_of(events)) == 8
    req = urllib.request.Request(h.router_url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": prompt(2500, 5000), "max_tokens": 6,
                                                  "ignore_eos": True}).encode())
    body = json.loads(urllib.request.urlopen(req).read())
    assert body["usage"] == {"prompt_tokens": 2500, "total_tokens": 2506, "completion_tokens": 6}
    assert body["choices"][0]["finish_reason"] == "length" and len(body["choices"][0]["text"].split()) == 6
    assert_blocks_back(h)


def test_decode_memory_is_never_double_booked(push_cluster: ClusterHandle) -> None:
    """The decode engine holds 400 blocks: one 4,000-token prompt (250 blocks) at a time; the rest wait."""
    h = push_cluster
    before = metric(h.router_url, "kvmesh_router_decode_reserve_rejections_total")

    async def main() -> list[list[int]]:
        results = await asyncio.gather(*(stream(h.router_url, {"prompt": prompt(4000, 20000 + 5000 * k),
                                                               "max_tokens": 30, "ignore_eos": True})
                                         for k in range(3)))
        return [tokens_of(ev) for _, ev in results]

    for toks in asyncio.run(main()):
        assert len(toks) == 30
    assert metric(h.router_url, "kvmesh_router_decode_reserve_rejections_total") > before
    assert_blocks_back(h)


def test_pull_hand_off_and_fallback_when_transfers_fail(ray_cluster: object) -> None:
    h = launch(pd_spec("pd-pull", "pull"))
    try:
        headers, events = asyncio.run(stream(h.router_url, {"prompt": prompt(3000, 1000), "max_tokens": 20,
                                                            "ignore_eos": True}))
        assert headers["X-Served-By"] == "d" and len(tokens_of(events)) == 20
        assert metric(h.engine_urls["d"], "kvmesh:kv_transfers_total", op="pull", outcome="ok") >= 1
        assert_blocks_back(h)
    finally:
        h.shutdown()
    h = launch(pd_spec("pd-faults", "push", transport={"faults": {"seed": 3, "rates": {"drop": 0.5}}},
                       disagg={"on_transfer_failure": "prefill", "transfer_timeout_ms": 200}))
    try:
        async def main() -> list[list[int]]:
            out = []
            for k in range(6):
                _, ev = await stream(h.router_url, {"prompt": prompt(2000, 3000 * k + 7), "max_tokens": 12,
                                                    "ignore_eos": True})
                out.append(tokens_of(ev))
            return out

        assert [len(t) for t in asyncio.run(main())] == [12] * 6  # no request lost
        assert metric(h.router_url, "kvmesh_router_kv_fallbacks_total", target="prefill") >= 1
        assert_blocks_back(h)
    finally:
        h.shutdown()


def test_a_decode_engine_killed_before_admission_releases_the_prefill_lease(ray_cluster: object) -> None:
    """Pull mode: decode dies while the prompt is on prefill; the router finds it gone after the prefill,
    releases the held blocks and finishes the request on prefill; nothing is lost, nothing leaks."""
    import ray

    h = launch(pd_spec("pd-kill", "pull", time_scale=4.0))
    try:
        async def main() -> list[int]:
            task = asyncio.create_task(stream(h.router_url, {"prompt": prompt(12_000, 77), "max_tokens": 10,
                                                             "ignore_eos": True}))
            await asyncio.sleep(0.4)  # 12,000 tokens at 40 per ms: ~300 emulated ms of prefill, 1.2 s wall
            h.kill_engine_actor("d")
            _, events = await task
            return tokens_of(events)

        assert len(asyncio.run(main())) == 10
        assert metric(h.router_url, "kvmesh_router_kv_fallbacks_total", target="prefill",
                      cause="decode_unreachable") == 1
        prefill = h.workers[h.engine_actor["p"]]
        for _ in range(100):
            load = ray.get(prefill.load.remote())["p"]
            if load["free_blocks"] == load["num_blocks"] and load["running"] == 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"prefill blocks not returned: {load}")
    finally:
        h.shutdown()
