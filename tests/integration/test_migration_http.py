"""Live migration and checkpoints between two engines over real HTTP and the real TCP KV transport (no Ray):
two worker hosts in this process (``GpuWorker``, as the Ray actors run them), each engine on its own port.

A request moved mid-stream goes on from the peer at the next token with the same tokens as an uninterrupted
run; a request whose engine dies resumes on its checkpoint peer with only the tokens since the checkpoint
recomputed. The router's part is in ``tests/unit/router/test_kv_migration.py`` and, end to end with Ray, in
``tests/chaos/test_migration.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from actors.worker import GpuWorker
from config import ClusterSpec
from tests.chaos.test_migration import spec_with

PROMPT = list(range(100, 400))
BODY: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 120, "stream": True, "output_token_ids": True,
                        "ignore_eos": True}


def parse(raw: bytes) -> tuple[list[int], dict[str, Any] | None]:
    ids: list[int] = []
    moved = None
    for ev in raw.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            obj = json.loads(ev[6:])
            if "kvmesh_migrated" in obj:
                moved = obj["kvmesh_migrated"]
            for c in obj.get("choices") or []:
                ids.extend(c.get("token_ids") or [])
    return ids, moved


@pytest.fixture
async def pair() -> AsyncIterator[tuple[GpuWorker, GpuWorker, dict[str, Any], dict[str, Any]]]:
    spec = ClusterSpec.model_validate(spec_with(1.0, live=True, checkpoints=True)).model_dump_json()
    src, dst = GpuWorker(spec, ["f"]), GpuWorker(spec, ["e-0"])
    f, e0 = (await src.start())["f"], (await dst.start())["e-0"]
    yield src, dst, f, e0
    for w in (src, dst):
        await w.stop()
    for w in (src, dst):
        for name, e in w.engines.items():
            assert e.kv.pool.num_free == e.cfg.num_blocks, f"{name} leaked KV blocks"


async def read_until(resp: aiohttp.ClientResponse, n: int) -> bytes:
    raw = b""
    while len(parse(raw)[0]) < n:
        chunk = await resp.content.readany()
        assert chunk, "the stream ended early"
        raw += chunk
    return raw


async def test_a_request_moved_mid_stream_goes_on_from_the_peer_token_for_token(pair: Any) -> None:
    src, dst, f, e0 = pair
    peer = {"name": "e-0", "url": e0["url"], "address": e0["kv_address"]}
    async with aiohttp.ClientSession() as s:
        async with s.post(f["url"] + "/v1/completions", json=BODY, headers={"X-Request-Id": "ref"}) as r:
            want, _ = parse(await r.read())
        async with s.post(f["url"] + "/v1/completions", json=BODY, headers={"X-Request-Id": "r"}) as r:
            raw = await read_until(r, 40)
            async with s.post(f["url"] + "/kvmesh/migrate/r", json={"peer": peer}) as m:
                assert m.status == 200
                moved = await m.json()
            raw += await r.read()
        first, marker = parse(raw)
        assert marker == {"to": "e-0", "token_index": len(first)} and moved["token_index"] == len(first)
        assert moved["blocks"] == -(-(len(PROMPT) + len(first) - 1) // 16)  # every block with KV moved
        assert moved["transfer_modelled_ms"] > 0 and moved["migration_ms"] >= moved["transfer_ms"]
        resume = {**BODY, "kv_transfer_params": {"resume": "migrated", "request_id": "r"}}
        async with s.post(e0["url"] + "/v1/completions", json=resume, headers={"X-Request-Id": "r"}) as r:
            assert r.status == 200 and r.headers["X-Kvmesh-Token-Index"] == str(len(first))
            rest, _ = parse(await r.read())
    assert first + rest == want
    assert dst.engines["e-0"].scheduler.stats.prompt_tokens == 0  # nothing of the prompt was recomputed
    assert dst.agents["e-0"].figures.migrated_in == 1 and src.agents["f"].figures.migrated_out == 1


async def test_a_killed_engines_request_resumes_from_its_checkpoint(pair: Any) -> None:
    src, dst, f, e0 = pair
    ck = {"name": "e-0", "url": e0["url"], "address": e0["kv_address"], "every": 32}
    async with aiohttp.ClientSession() as s:
        async with s.post(f["url"] + "/v1/completions", json=BODY, headers={"X-Request-Id": "ref"}) as r:
            want, _ = parse(await r.read())
        body = {**BODY, "kv_transfer_params": {"checkpoint": ck}}
        async with s.post(f["url"] + "/v1/completions", json=body, headers={"X-Request-Id": "r"}) as r:
            have, _ = parse(await read_until(r, 80))
            src.agents["f"].watching.clear()  # a dead engine says nothing to its checkpoint peer
            await src.stop()  # the engine dies under its client
        peer = dst.agents["e-0"]
        assert list(peer.checkpoints) == ["r"]
        covered = peer.checkpoints["r"].covered_tokens
        # checkpoints after tokens 1, 33 and 65, each of the whole 16-token blocks with KV then
        assert covered == (len(PROMPT) + 64) // 16 * 16
        resume = {**BODY, "kv_transfer_params": {"resume": "checkpoint", "request_id": "r", "output_ids": have}}
        async with s.post(e0["url"] + "/v1/completions", json=resume, headers={"X-Request-Id": "r"}) as r:
            assert r.status == 200 and r.headers["X-Kvmesh-Token-Index"] == str(len(have))
            rest, _ = parse(await r.read())
    assert have + rest == want
    recomputed = len(PROMPT) + len(have) - 1 - covered
    assert peer.figures.recomputed[-1] == recomputed and recomputed < 32 + 16
    assert peer.figures.resumed_from_checkpoint == 1
    per32 = list(peer.figures.checkpoint_ms_per_32)
    assert len(per32) >= 2 and all(x > 0 for x in per32)
    assert all(m > 0 for m in peer.figures.checkpoint_modelled_ms_per_32)
