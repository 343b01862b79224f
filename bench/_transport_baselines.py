"""The baselines ``bench/transport.py`` sets kvmesh's transport beside, and the receivers it runs in other processes.

- bare TCP: a blocking-socket receiver and an event loop's ``BufferedProtocol`` into one preallocated
  buffer (throughput), and ping-pongs (latency): blocking socket to blocking socket, and event loop to that
  event loop receiver (``event_loop_pingpong``);
- UCX: ``ucx_perftest -t tag_bw`` from the libucx wheel and a tuned bare libucxx loop
  (``UCX_WINDOW`` messages in flight, no framing);
- kvmesh's own tcp and ucx receivers, which drop what they receive.

Each receiver is this module run as ``--child KIND`` (see ``Child``): it prints its address and serves
until its stdin closes, so sender and receiver each have a core.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import uvloop

from actors.clock import Clock
from transport import Block, RequestId, Site, TransportOptions
from transport.base import Address, Releasable
from transport.tcp import TcpTransport
from transport.verify import VERIFY_THREAD_MIN

MiB = 1 << 20
SENDER, RECEIVER = Site("bench-a", "local"), Site("bench-b", "local")
HERE = Path(__file__).resolve()


# -- child processes ------------------------------------------------------------------------------
def make_sink(t: Any) -> None:
    """Receive everything and drop it at once (the receiver still decodes, verifies and commits)."""

    def deliver(request_id: RequestId, blocks: Sequence[Block], leases: Sequence[Releasable | None] = ()) -> None:
        for lease in leases:
            if lease is not None:
                lease.release()

    t.inbox.deliver = deliver


async def child_tcp_sink(verify_thread_min_bytes: int | None = None) -> None:
    """kvmesh's tcp receiver; ``verify_thread_min_bytes`` as in ``TransportOptions`` (None: the default)."""
    opts = {} if verify_thread_min_bytes is None else {"verify_thread_min_bytes": verify_thread_min_bytes}
    t = TcpTransport(RECEIVER, Clock(), TransportOptions(pool_bytes=1 << 30, **opts))
    make_sink(t)
    addr = await t.serve()
    print(addr.location, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await t.close()


async def child_ucx_sink(verify_thread_min_bytes: int | None = None) -> None:
    """kvmesh's ucx receiver; ``verify_thread_min_bytes`` as in ``TransportOptions`` (None: the default)."""
    from transport.ucx import UcxTransport

    opts = {} if verify_thread_min_bytes is None else {"verify_thread_min_bytes": verify_thread_min_bytes}
    t = UcxTransport(RECEIVER, Clock(), TransportOptions(pool_bytes=1 << 30, **opts))
    make_sink(t)
    addr = await t.serve()
    print("|".join([addr.location, *(f"{k}={v.hex()}" for k, v in addr.extra)]), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await t.close()


def child_bare_sink() -> None:
    """A blocking socket receiver: per message an 8-byte length, the bytes, then a 1-byte answer."""
    import threading

    def exit_when_parent_closes_stdin() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=exit_when_parent_closes_stdin, daemon=True).start()
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()
    print(f"127.0.0.1:{ls.getsockname()[1]}", flush=True)
    buf = memoryview(bytearray(MiB))
    head = bytearray(8)
    while True:  # one connection at a time; a zero length ends it; the parent closing stdin ends us
        conn, _ = ls.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while conn.recv_into(head, 8, socket.MSG_WAITALL) == 8:
            (left,) = struct.unpack("<Q", head)
            if not left:
                break
            while left:
                n = conn.recv_into(buf, min(left, MiB))
                if not n:
                    break
                left -= n
            conn.sendall(b"k")
        conn.close()


class BufferedSink(asyncio.BufferedProtocol):
    """The bare protocol of ``child_bare_sink`` received by an event loop straight into one preallocated buffer."""

    def __init__(self) -> None:
        self.buf = memoryview(bytearray(4 * MiB))
        self.head = bytearray()
        self.left = -1  # -1: reading a length
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        pos = 0
        while pos < nbytes:
            if self.left < 0:
                take = min(8 - len(self.head), nbytes - pos)
                self.head += self.buf[pos:pos + take]
                pos += take
                if len(self.head) == 8:
                    (self.left,) = struct.unpack("<Q", self.head)
                    self.head.clear()
                    if self.left == 0:
                        assert self.transport is not None
                        self.transport.close()
                        return
            else:
                take = min(self.left, nbytes - pos)
                self.left -= take
                pos += take
                if self.left == 0:
                    self.left = -1
                    assert self.transport is not None
                    self.transport.write(b"k")


async def child_buffered_sink() -> None:
    server = await asyncio.get_running_loop().create_server(BufferedSink, "127.0.0.1", 0)
    print(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()


class Child:
    """This script run as ``--child KIND`` in another process; it prints its address, serves until stdin closes."""

    def __init__(self, kind: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-u", str(HERE), "--child", kind], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**(env or os.environ), "UCX_WARN_UNUSED_ENV_VARS": "n"})
        assert self.proc.stdout is not None
        self.location = self.proc.stdout.readline().strip()
        if not self.location:
            raise RuntimeError(f"child {kind} did not start")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()



def bare_throughput(location: str, total: int, reps: int) -> float:
    host, port = location.split(":")
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = np.random.default_rng(1).integers(0, 256, MiB, dtype=np.uint8).tobytes()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        s.sendall(struct.pack("<Q", total))
        for _ in range(total // MiB):
            s.sendall(payload)
        s.recv(1)
        best = min(best, time.perf_counter() - t0)
    s.sendall(struct.pack("<Q", 0))
    s.close()
    return best


def bare_pingpong(location: str, size: int, n: int) -> list[float]:
    host, port = location.split(":")
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = struct.pack("<Q", size) + bytes(size)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.sendall(msg)
        s.recv(1)
        lat.append((time.perf_counter() - t0) * 1e6)
    s.sendall(struct.pack("<Q", 0))
    s.close()
    return lat



async def event_loop_pingpong(location: str, size: int, n: int) -> list[float]:
    """``bare_pingpong``'s round trips from an event loop (this process's, uvloop in the benchmark) to the event
    loop receiver of ``child_buffered_sink``, with no framing and no work but the echo: the least any transport
    built on asyncio, as kvmesh's is, pays per acknowledged message on this host, where ``bare_pingpong``'s two
    blocking sockets skip the event loop's wake-up and callbacks on both ends."""
    loop = asyncio.get_running_loop()
    host, port = location.split(":")

    class Echoed(asyncio.Protocol):
        waiter: asyncio.Future[None] | None = None

        def data_received(self, data: bytes) -> None:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

    transport, proto = await loop.create_connection(Echoed, host, int(port))
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = struct.pack("<Q", size) + bytes(size)
    lat = []
    try:
        for _ in range(n):
            proto.waiter = loop.create_future()
            t0 = time.perf_counter()
            transport.write(msg)
            await proto.waiter
            lat.append((time.perf_counter() - t0) * 1e6)
        transport.write(struct.pack("<Q", 0))
    finally:
        transport.close()
    return lat


# -- ucx ------------------------------------------------------------------------------------------
UCX_TRANSPORTS = {"sm": "sm,self", "tcp": "tcp,self"}
"""The transports the ucx figures are measured over, each against ucx_perftest over the same one."""
UCX_WINDOW = 32
"""Messages the tuned bare loop keeps in flight (ucx_perftest's tag_bw keeps a window in flight too)."""


def ucx_unavailable() -> str | None:
    from transport.ucx import ucx_available

    reason = ucx_available()
    return None if reason is None else f"ucxx does not import here ({reason}); install the 'ucx' extra"


def ucx_env(tls: str) -> dict[str, str]:
    """The environment of a UCX process in this bench: UCX's defaults (not ucxx's), the given transports."""
    from transport.ucx_worker import _UCXX_ENV

    env = {k: v for k, v in os.environ.items() if not (k in _UCXX_ENV and v == _UCXX_ENV[k])}
    return {**env, "UCX_TLS": tls, "UCX_WARN_UNUSED_ENV_VARS": "n"}


@contextlib.contextmanager
def ucx_environment(env: dict[str, str]) -> Iterator[None]:
    """This process's environment with ``env`` applied (its UCX contexts read it when created), then restored."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def perftest_exe() -> Path | None:
    try:
        import libucx
    except ImportError:
        return None
    exe = Path(libucx.__file__).resolve().parent / "bin" / "ucx_perftest"
    return exe if exe.exists() else None


def ucx_perftest(tls: str, size: int, iters: int) -> dict[str, Any]:
    """``ucx_perftest -t tag_bw`` between two processes on 127.0.0.1 over ``tls``: GB/s (overall)."""
    exe = perftest_exe()
    if exe is None:
        return {"skipped": "ucx_perftest is not in the libucx wheel here"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    lib = str(exe.parent.parent / "lib")
    env = {**ucx_env(tls), "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [lib, os.environ.get("LD_LIBRARY_PATH")]))}
    args = ["-t", "tag_bw", "-s", str(size), "-n", str(iters), "-p", port]
    server = subprocess.Popen([str(exe), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):  # the server needs a moment to listen
            time.sleep(0.2)
            r = subprocess.run([str(exe), "127.0.0.1", *args], env=env, capture_output=True, text=True, timeout=120)
            final = [ln for ln in r.stdout.splitlines() if ln.startswith("Final:")]
            if final:
                cols = final[-1].split()
                mb_s = float(cols[6])  # overall bandwidth, MB/s with MB = 2**20 bytes
                return {"gbps": round(mb_s * MiB / 1e9, 3), "tls": tls, "size": size, "iters": iters,
                        "command": f"ucx_perftest -t tag_bw -s {size} -n {iters} (UCX_TLS={tls})"}
        return {"skipped": "ucx_perftest's client never connected"}
    finally:
        server.kill()
        server.wait()


async def child_ucx_bare_sink(buffers: int = UCX_WINDOW) -> None:
    """The tuned bare loop's receiver: libucxx on an event loop, ``UCX_WINDOW`` receives posted, no framing.

    Serves one sender at a time, until its stdin closes: a hello (the sender's worker address), then rounds of
    a count and that many 1 MiB messages, each round acknowledged; a count of zero ends the sender's turn. The
    receives land in ``buffers`` distinct 1 MiB buffers in turn (``UCX_WINDOW``: every posted receive has its
    own, as a receiver keeping what it gets must); with 1 every message lands in the same buffer, cache-hot, as
    ``ucx_perftest`` receives (one buffer per side, reused for every message; its CMA copy then runs at cache
    speed).
    """
    from transport.ucx_worker import UcxWorker, close_endpoint

    w = UcxWorker()
    loop = asyncio.get_running_loop()
    print(w.address.hex(), flush=True)
    own = [np.empty(MiB, dtype=np.uint8) for _ in range(buffers)]
    bufs = [own[i % buffers] for i in range(UCX_WINDOW)]
    head = np.empty(1, dtype=np.uint64)

    async def recv_one(ep: Any, buf: Any, tag: int) -> None:
        fut: asyncio.Future[None] = loop.create_future()
        if ep is None:
            w.recv_any(buf, tag, lambda _e: fut.set_result(None))
        else:
            w.recv(ep, buf, tag, lambda _e: fut.set_result(None))
        await fut

    async def receive_round(ep: Any, count: int) -> None:
        state = {"left": count, "posted": min(count, UCX_WINDOW)}
        all_in: asyncio.Future[None] = loop.create_future()

        def one(_e: BaseException | None) -> None:
            state["left"] -= 1
            if state["posted"] < count:
                w.recv(ep, bufs[state["posted"] % UCX_WINDOW], 3, one)
                state["posted"] += 1
            if state["left"] == 0:
                all_in.set_result(None)

        for i in range(state["posted"]):
            w.recv(ep, bufs[i], 3, one)
        await all_in

    async def serve() -> None:
        while True:
            hello = bytearray(4096)
            await recv_one(None, hello, 1)
            n = int.from_bytes(hello[:2], "little")
            ep = w.endpoint(bytes(hello[2:2 + n]), False)
            while True:
                await recv_one(ep, head, 2)
                count = int(head[0])
                if count == 0:
                    break
                await receive_round(ep, count)
                await w.wait_send(ep, np.ones(1, dtype=np.uint8), 4)
            close_endpoint(ep)

    serving = asyncio.ensure_future(serve())
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes stdin (Child.close: 10 s, then a kill)
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    await w.close()


def resolve(fut: asyncio.Future[None], _exc: BaseException | None) -> None:
    if not fut.done():
        fut.set_result(None)


async def send_window(w: Any, ep: Any, payload: Any, count: int) -> None:
    """Send ``payload`` ``count`` times, ``UCX_WINDOW`` sends in flight."""
    window = asyncio.Semaphore(UCX_WINDOW)

    async def one() -> None:
        async with window:
            await w.wait_send(ep, payload, 3)

    await asyncio.gather(*(one() for _ in range(count)))


async def ucx_bare_throughput(location: str, total: int, reps: int) -> float:
    """The tuned bare loop's sender: ``UCX_WINDOW`` 1 MiB sends in flight, acknowledged per round."""
    from transport.ucx_worker import UcxWorker, close_endpoint

    w = UcxWorker()
    ep = w.endpoint(bytes.fromhex(location), False)
    hello = bytearray(4096)
    hello[:2] = len(w.address).to_bytes(2, "little")
    hello[2:2 + len(w.address)] = w.address
    await w.wait_send(ep, hello, 1)
    payload = np.random.default_rng(1).integers(0, 256, MiB, dtype=np.uint8)
    ack = np.empty(1, dtype=np.uint8)
    count = total // MiB
    best = float("inf")
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        await w.wait_send(ep, np.array([count], dtype=np.uint64), 2)
        got: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        w.recv(ep, ack, 4, functools.partial(resolve, got))
        await send_window(w, ep, payload, count)
        await got
        if rep:
            best = min(best, time.perf_counter() - t0)
    await w.wait_send(ep, np.array([0], dtype=np.uint64), 2)
    await asyncio.sleep(0.05)
    close_endpoint(ep)
    await w.close()
    return best


def ucx_address(location_line: str) -> Address:
    location, *extras = location_line.split("|")
    extra = tuple((k, bytes.fromhex(v)) for k, v in (e.split("=", 1) for e in extras))
    return Address("ucx", location, RECEIVER, extra)


CHILDREN: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
    "tcp-sink": child_tcp_sink, "ucx-sink": child_ucx_sink, "ucx-bare-sink": child_ucx_bare_sink,
    "ucx-bare-sink-one-buffer": functools.partial(child_ucx_bare_sink, 1),
    "buffered-sink": child_buffered_sink,
    "ucx-sink-inline": functools.partial(child_ucx_sink, 0),  # every payload verified on the loop's thread
    "ucx-sink-thread": functools.partial(child_ucx_sink, VERIFY_THREAD_MIN),  # large ones on the verifier thread
    "tcp-sink-inline": functools.partial(child_tcp_sink, 0),
}


def child_main(kind: str) -> None:
    """Run the receiver ``kind`` in this process until stdin closes. Every kind, kvmesh's and the bare ones alike,
    starts with its imports taken out of the cyclic collector's sight, as the product's actors do
    (``actors.worker.freeze_heap``): one 512 MiB ucx run's unfrozen receiver paid a 44 ms full collection."""
    gc.collect()
    gc.freeze()
    if kind == "bare-sink":
        child_bare_sink()
        return
    uvloop.run(CHILDREN[kind]())


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--child" or sys.argv[2] not in {"bare-sink", *CHILDREN}:
        sys.exit(f"usage: {sys.argv[0]} --child {{bare-sink,{','.join(CHILDREN)}}}")
    child_main(sys.argv[2])
