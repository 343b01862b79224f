"""A real local Ray cluster of emulated engines behind the router: OpenAI API end to end."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.cost_model import RooflineCostModel, request_colocated
from actors.openai_api import MAX_BODY_BYTES
from cluster.launch import ClusterHandle, launch
from config import ClusterSpec, default_catalog

SPEC = {
    "name": "it-2xh100",
    "time_scale": 1.0,
    "nodes": [{"name": "n0", "region": "local", "hardware": "h100-80g-sxm", "gpus": 2,
               "engines": [{"name": "e", "model": "llama-3.1-8b", "replicas": 2,
                            "scheduler": {"max_num_batched_tokens": 8192}}]}],
    "router": {"policy": "least_loaded"},
}


@pytest.fixture(scope="module")
def cluster(ray_cluster: object) -> Iterator[ClusterHandle]:
    handle = launch(ClusterSpec.model_validate(SPEC))
    try:
        yield handle
    finally:
        handle.shutdown()


def rand_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 128000) for _ in range(n)]


def test_openai_client_streams_a_chat_completion_through_the_router(cluster: ClusterHandle) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=cluster.router_url + "/v1", api_key="none")
    models = [m.id for m in client.models.list()]
    assert models == ["llama-3.1-8b"]
    stream = client.chat.completions.create(
        model="llama-3.1-8b", messages=[{"role": "user", "content": "Say something."}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, usage, reasons = "", None, []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 0
    assert reasons[-1] == "length" and len(text.split()) == 12
    full = client.completions.create(model="llama-3.1-8b", prompt="Hello there", max_tokens=5)
    assert full.usage is not None and full.usage.completion_tokens <= 5 and full.choices[0].text


async def _stream(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, int, float, float]:
    t0 = time.monotonic()
    first = None
    n = 0
    usage = -1
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]["completion_tokens"]
            for c in obj.get("choices", []):
                if c.get("text"):
                    n += 1
                    if first is None:
                        first = time.monotonic()
    end = time.monotonic()
    assert first is not None
    return n, usage, first - t0, end - t0


def test_200_concurrent_requests_complete_with_the_right_token_counts(cluster: ClusterHandle) -> None:
    async def main() -> list[tuple[int, int, float, float]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            bodies = [{"prompt": rand_prompt(64 + i % 50, i), "max_tokens": 4 + i % 13, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}} for i in range(200)]
            return await asyncio.gather(*(_stream(s, cluster.router_url + "/v1/completions", b) for b in bodies))

    results = asyncio.run(main())
    for i, (n, usage, _, _) in enumerate(results):
        assert n == 4 + i % 13 and usage == n
    load = cluster.load()
    assert all(v["running"] == 0 and v["free_blocks"] == v["num_blocks"] for v in load.values())
    assert all(v["steps"] > 0 for v in load.values())  # least_loaded spread the burst


def test_low_load_ttft_and_tpot_match_the_cost_model(cluster: ClusterHandle) -> None:
    cat = default_catalog()
    cost = RooflineCostModel(cat.hardware.get("h100-80g-sxm"), cat.models.get("llama-3.1-8b"), 1)
    prompt, output = 16000, 64  # a long prefill, so HTTP's few milliseconds stay well inside 5%
    expected = request_colocated(cost, prompt, output, 8192)
    engine_url = next(iter(cluster.engine_urls.values()))

    async def main() -> list[tuple[int, int, float, float]]:
        async with aiohttp.ClientSession() as s:
            out = []
            for k in range(3):
                body = {"prompt": rand_prompt(prompt, 1000 + k), "max_tokens": output, "ignore_eos": True,
                        "stream": True}
                # Straight to an engine: the router's own overhead is bench/router.py's figure.
                out.append(await _stream(s, engine_url + "/v1/completions", body))
            return out

    runs = asyncio.run(main())
    ttft_ms = sorted(r[2] * 1000 for r in runs)[1]
    tpot_ms = sorted((r[3] - r[2]) * 1000 / (output - 1) for r in runs)[1]
    assert ttft_ms == pytest.approx(expected.ttft_ms, rel=0.05)
    assert tpot_ms == pytest.approx(expected.tpot_ms, rel=0.05)


def test_metrics_parse_back_with_vllm_names(cluster: ClusterHandle) -> None:
    import urllib.request

    url = next(iter(cluster.engine_urls.values()))
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "kvmesh:step_lag_ms", "kvmesh:step_time_ms"):
        assert name in names, name
    router_text = urllib.request.urlopen(cluster.router_url + "/metrics").read().decode()
    assert any(f.name == "kvmesh_router_decisions" for f in text_string_to_metric_families(router_text))


@pytest.mark.parametrize(("body", "status", "fragment"), [
    (b"{not json", 400, "not valid JSON"),
    (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"max_tokens": 3}', 400, "prompt"),
    (b'{"prompt": 12}', 400, "prompt"),
    (b'{"prompt": "hi", "model": "gpt-9"}', 404, "does not exist"),
    (b'{"prompt": [1, 2, 3], "max_tokens": 131070}', 400, "maximum context length"),
    (b'{"prompt": [-5, 2]}', 400, "token ids"),
    (b'{"prompt": "hi", "n": 2}', 400, "n=1"),
    (b"[1, 2]", 400, "JSON object"),
])
def test_bad_input_gets_a_clear_error_and_breaks_nothing(cluster: ClusterHandle, body: bytes, status: int,
                                                         fragment: str) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            for base in (cluster.router_url, next(iter(cluster.engine_urls.values()))):
                async with s.post(base + "/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    assert r.status == status
                    err = (await r.json())["error"]
                    assert fragment in err["message"] and err["code"] == status
            async with s.post(cluster.router_url + "/v1/completions",
                              json={"prompt": "still fine", "max_tokens": 2, "ignore_eos": True}) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2

    asyncio.run(main())


def test_the_routers_socket_survives_garbage_and_speaks_plain_http(cluster: ClusterHandle) -> None:
    """Raw bytes on a real socket: not-HTTP gets a 400 and a close; a curl-style upload (100-continue,
    chunked) and an HTTP/1.0 request are served; an oversized body gets a 413 before it is sent; the router
    serves on."""
    host, port = cluster.router_url.removeprefix("http://").split(":")

    async def exchange(data: bytes, *, pause_after_head: bool = False) -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            if pause_after_head:
                head, _, body = data.partition(b"\r\n\r\n")
                writer.write(head + b"\r\n\r\n")
                assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 100")
                data = body
            writer.write(data)
            return await asyncio.wait_for(reader.read(), 30)  # every case here ends with the server closing
        finally:
            writer.close()

    def status(answer: bytes) -> int:
        return int(answer.split(b" ", 2)[1])

    async def main() -> None:
        out = await exchange(b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03garbage\r\n\r\n")
        assert status(out) == 400
        body = json.dumps({"prompt": "hello " * 400, "max_tokens": 2, "ignore_eos": True}).encode()
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[:1000], body[1000:])) + b"0\r\n\r\n"
        out = await exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Expect: 100-continue\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                             + chunked, pause_after_head=True)
        assert status(out) == 200
        assert json.loads(out.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 2
        out = await exchange(b"GET /v1/models HTTP/1.0\r\n\r\n")
        assert status(out) == 200 and b"llama" in out
        out = await exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                             % (MAX_BODY_BYTES + 1))
        assert status(out) == 413
        async with aiohttp.ClientSession() as s, s.post(cluster.router_url + "/v1/completions",
                                                        json={"prompt": "still fine", "max_tokens": 2}) as r:
            assert r.status == 200

    asyncio.run(main())


def test_client_disconnect_frees_the_sequence_and_its_blocks(cluster: ClusterHandle) -> None:
    url = next(iter(cluster.engine_urls.values()))

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            for base in (url, cluster.router_url):
                r = await s.post(base + "/v1/completions", json={"prompt": rand_prompt(3000, 7), "max_tokens": 5000,
                                                                 "ignore_eos": True, "stream": True})
                got = 0
                async for line in r.content:
                    got += line.startswith(b"data: ")
                    if got >= 3:
                        break
                r.close()  # drop the connection mid-stream

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = cluster.load()
        if all(v["running"] == 0 and v["waiting"] == 0 and v["free_blocks"] == v["num_blocks"]
               for v in load.values()):
            break
        time.sleep(0.1)
    load = cluster.load()
    assert all(v["running"] == 0 and v["free_blocks"] == v["num_blocks"] for v in load.values()), load
