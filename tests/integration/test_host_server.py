"""Several engines behind one HTTP server (``actors.host_server``): addressed by path, killed one at a time.

Real sockets and HTTP, no Ray: two engines of one process on one port, the router's feed client at the root.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.engine.engine import Engine
from actors.feed import FeedHub
from actors.host_server import HostServer, engine_of_path
from actors.metrics import EngineMetrics
from actors.server import YIELD_AFTER_BODY_BYTES, EngineServer
from cluster.loadtest.scrape import RUNNING, WAITING, TargetProbe, only_metrics, parse_metrics
from cluster.router.feed import FeedClient
from cluster.router.prefix_index import PrefixIndex
from cluster.router.view import WorkerId, WorkerInfo
from tests.integration.test_feed import make_engine


@pytest.fixture
async def host() -> AsyncIterator[tuple[HostServer, dict[str, Engine]]]:
    hub = FeedHub()
    server = HostServer(hub)
    engines: dict[str, Engine] = {}
    for n in ("a", "b"):
        e = make_engine(n)
        engines[n] = e
        server.mount(n, EngineServer(e, EngineMetrics("lesson", n), hub=hub))
        e.start()
    await server.start()
    try:
        yield server, engines
    finally:
        await server.stop()
        for e in engines.values():
            await e.stop()
            assert e.num_running == 0 and e.kv.pool.num_free == e.cfg.num_blocks


def test_engine_of_path() -> None:
    assert engine_of_path("/e/a/v1/completions") == "a"
    assert engine_of_path("/e/b") == "b"
    assert engine_of_path("/kvmesh/feed") is None
    assert engine_of_path("/e/") is None


async def test_mounting_after_start_or_twice_is_refused(host: tuple[HostServer, dict[str, Engine]]) -> None:
    server, engines = host
    with pytest.raises(RuntimeError):
        server.mount("c", EngineServer(engines["a"], EngineMetrics("lesson", "c")))
    fresh = HostServer(FeedHub())
    fresh.mount("x", EngineServer(engines["a"], EngineMetrics("lesson", "x"), hub=fresh.hub))
    with pytest.raises(ValueError):
        fresh.mount("x", EngineServer(engines["b"], EngineMetrics("lesson", "x2"), hub=fresh.hub))
    with pytest.raises(ValueError):
        fresh.mount("a/b", EngineServer(engines["b"], EngineMetrics("lesson", "y"), hub=fresh.hub))


async def test_each_engine_answers_on_its_own_path_of_one_port(host: tuple[HostServer, dict[str, Engine]]) -> None:
    server, engines = host
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        for n in ("a", "b"):
            url = server.engine_url(n)
            assert url.startswith(server.url + "/e/")
            async with s.get(url + "/health") as r:
                assert r.status == 200
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 6
        for n in ("a", "b"):  # each engine's own metrics, at its own path
            async with s.get(server.engine_url(n) + "/metrics") as r:
                text = await r.text()
                assert f'engine="{n}"' in text and f'engine="{"b" if n == "a" else "a"}"' not in text
        async with s.post(server.url + "/e/ghost/v1/completions", json=body) as r:
            assert r.status == 404
    # every request went to the engine its path named, and nowhere else
    assert engines["a"].kv.pool.num_free == engines["a"].cfg.num_blocks


async def test_the_depth_poll_gets_an_engines_two_gauges_alone(host: tuple[HostServer, dict[str, Engine]]) -> None:
    """The load test's poll asks each engine for its queue gauges by name (``name[]``): the engine renders those
    alone, with the values its whole page has."""
    server, _ = host
    url = server.engine_url("a")
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
        async with s.get(url + "/metrics", params=[("name[]", RUNNING), ("name[]", WAITING)]) as r:
            cut = await r.text()
        async with s.get(url + "/metrics") as r:
            whole = await r.text()
        polled = await TargetProbe(s, server.url).page(url, (RUNNING, WAITING))
    assert {f.name for f in text_string_to_metric_families(cut)} == {RUNNING, WAITING}
    assert polled is not None and set(polled.samples) == {RUNNING, WAITING}
    assert polled.samples == parse_metrics(only_metrics(whole, (RUNNING, WAITING))).samples


async def test_killing_one_engine_cuts_its_streams_and_spares_the_other(
        host: tuple[HostServer, dict[str, Engine]]) -> None:
    server, engines = host
    body = {"prompt": list(range(16, 80)), "max_tokens": 2000, "ignore_eos": True, "stream": True}
    index = PrefixIndex()
    async with aiohttp.ClientSession() as s:
        feed = FeedClient(server.url, index, s, time.monotonic)
        workers = {n: WorkerInfo(WorkerId(n), server.engine_url(n)) for n in ("a", "b")}
        for w in workers.values():
            await feed.add(w)
        feed.start()

        async def stream(name: str, tokens: list[int], killed: asyncio.Event) -> str:
            try:
                async with s.post(server.engine_url(name) + "/v1/completions", json=body) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            tokens.append(1)
                            if len(tokens) == 20 and name == "a":
                                killed.set()
                            if killed.is_set() and name == "b" and len(tokens) >= 40:
                                return "alive"
                return "ended"
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                return "cut"

        try:
            async with asyncio.timeout(20):
                while not all(w.feed_connected for w in workers.values()):
                    await asyncio.sleep(0.01)
                killed = asyncio.Event()
                got_a: list[int] = []
                got_b: list[int] = []
                ta = asyncio.ensure_future(stream("a", got_a, killed))
                tb = asyncio.ensure_future(stream("b", got_b, killed))
                await killed.wait()
                server.kill("a")
                await engines["a"].stop()
                assert await ta == "cut"  # no final chunk, no [DONE]: as if the process died
                assert await tb == "alive"  # the other engine of the process streams on
                while workers["a"].feed_connected:  # the feed said "gone"
                    await asyncio.sleep(0.01)
                assert workers["b"].feed_connected
                with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
                    async with s.post(server.engine_url("a") + "/v1/completions", json=body) as r:
                        await r.read()
                async with s.get(server.engine_url("b") + "/health") as r:
                    assert r.status == 200
        finally:
            await feed.stop()
    assert engines["a"].num_running == 0 and engines["a"].kv.pool.num_free == engines["a"].cfg.num_blocks


@pytest.mark.parametrize("interval", [1, 4])
async def test_stream_interval_sends_the_first_token_at_once_then_groups(interval: int) -> None:
    engine = make_engine("s")
    server = EngineServer(engine, EngineMetrics("lesson", "s"), stream_interval=interval)
    engine.start()
    url = await server.start()
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 10, "ignore_eos": True, "stream": True, "return_token_ids": True}
    try:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
            events = [json.loads(line[6:]) async for line in r.content
                      if line.startswith(b"data: {")]
    finally:
        await server.stop()
        await engine.stop()
    sizes = [len(e["choices"][0]["token_ids"]) for e in events if e["choices"]]
    assert sum(sizes) == 10
    assert sizes == ([1] * 10 if interval == 1 else [1, 4, 4, 1])
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(ValueError):
        EngineServer(engine, EngineMetrics("lesson", "t"), stream_interval=0)


async def test_a_long_prompt_is_served_and_its_blocks_hit_on_the_next_request(
        host: tuple[HostServer, dict[str, Engine]]) -> None:
    """A body past ``YIELD_AFTER_BODY_BYTES`` (parsed, then admitted a loop turn later) with hashes computed as
    its chunks fill: the same prompt again hits every full block but the last token's."""
    server, engines = host
    n = 12_000
    prompt = [16 + (i * 7919) % 30_000 for i in range(n)]
    raw = json.dumps({"prompt": prompt, "max_tokens": 3, "ignore_eos": True}).encode()
    assert len(raw) >= YIELD_AFTER_BODY_BYTES
    async with aiohttp.ClientSession() as s:
        cached = []
        for _ in range(2):
            async with s.post(server.engine_url("a") + "/v1/completions", data=raw,
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200
                usage = (await r.json())["usage"]
            assert usage["prompt_tokens"] == n and usage["completion_tokens"] == 3
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    bs = engines["a"].cfg.block_size
    assert cached == [0, (n - 1) // bs * bs]
