"""Where kvmesh's ucx time goes: the receiver's event-loop thread per MiB, and how each worker sleep ends.

Two questions ``bench/transport.py`` cannot answer from its throughput and latency figures:

- **Bulk (1 MiB messages):** the receiver is the bottleneck (its data receives stay posted; the sender
  waits), so its event-loop thread's CPU time per MiB bounds the rate. The thread's time is split into
  ``progress`` (inside ``worker.progress_once``: UCX's protocol and the copy itself, a
  ``process_vm_readv`` over shared memory), ``callbacks`` (completion callbacks run by the worker's
  reap: framing, pool, posting receives, checksum checks, delivery and its acknowledgement, ucx's
  default since checksums run on the worker's thread) and ``rest`` (everything else the loop ran:
  idle spins, flushes, a verifier thread's results where one is configured). Measured for kvmesh's
  receiver and for the tuned bare loop's receiver (``bench/_transport_baselines.py``) moving the same
  bytes.
- **4 KiB pushes:** each side's worker spins for ``SPIN_S`` after its last completion, then arms and
  sleeps on UCX's event descriptor. For each sleep: how it ended (``fd``: UCX signalled;
  ``post``: this side posted a request; ``idle_poll``: nothing came within ``IDLE_POLL_S``) and how
  long it lasted; ``not_armed`` counts sleeps refused because events were pending.

Every worker here is :class:`ProfiledWorker`, a :class:`transport.ucx_worker.UcxWorker` whose progress
loop also reads the thread's CPU clock (about 1 us per loop iteration, so throughput here runs a little
below ``bench/transport.py``'s). The receivers run in child processes (this script with ``--child``),
so sender and receiver each have a core. Figures depend on what else the host runs: compare kvmesh
with the bare loop within one run.

Measured (locked, host contended by other sessions' nice-19 work, load 3.6-4.8; direction only):

- Bulk, receiver thread us/MiB (thread CPU = progress + callbacks + rest): sm bare 275 = 218 + 6 + 50
  at 2.94 GB/s, kvmesh 347 = 180 + 70 + 97 at 1.69 GB/s; tcp bare 347 = 266 + 14 + 67 at 2.47 GB/s,
  kvmesh 469 = 210 + 112 + 147 at 1.17 GB/s; kvmesh spins 18-20 times per MiB against 2.5-5.5. The
  receiver's thread is on a core for only about 55% of kvmesh's wall time (about 77% of the bare
  loop's): its CPU per MiB alone would allow 0.79x the bare loop, the rate is 0.47-0.58x.
- 4 KiB pushes are bistable. While each answer arrives within ``SPIN_S`` of the request, neither
  side sleeps and a push takes 118-140 us (sm); once one answer is late, both sides sleep between
  pushes, every sleep ends by UCX's fd after 620-780 us (sm; 340-480 tcp) and most sleeps are first
  refused (``not_armed``), so a push takes 1.2-1.5 ms (sm), 0.6 ms (tcp), and stays there. The same
  sender and receiver gave 118 us in one run and 1.2-1.5 ms in four others, with or without a bare loop
  run before. A longer spin on both sides made it worse (0.5 ms: 2.9 ms a push; 1 ms: 4.9 ms; 10 ms:
  8 ms), a 10 ms spin on one side only gave 193-204 us.

After checksums moved onto the worker's thread and idle spins began to ``sched_yield`` (``--quick``,
locked, load 2.5, two runs each, alternated with the code before; direction only): kvmesh's sm receiver
646/651 -> 580/624 us/MiB (callbacks 239/225 -> 314/325 now holding the checks and deliveries, rest
135/140 -> 34/51), tcp 1017/841 -> 817/804; 4 KiB push p50 sm 659/563 -> 430/697 us, tcp 947/777 ->
373/389 us. The bare loop's receiver (the same worker) moved too: sm 2.28/2.40 -> 3.78/1.56 GB/s.

Completions reaped after each progress step and the lighter sleep (3356c99, ab05c47), ``--quick``, locked,
alternated with f3f408a, load 3.5-7 (direction only). Receiver thread us/MiB, kvmesh (bare loop of the
same run): sm 628 (481), 825 (527) -> 505 (431), 532 (439); tcp 955 (792), 984 (759) -> 904 (622), 663
(712). ``callbacks`` is not all Python: a payload's receive is posted after its RTS has arrived, so UCX's
match and the start of the transfer run inside ``tag_recv`` there. Split of kvmesh's sm receiver by thread
CPU wrappers (``/tmp`` harness, 512 MiB, contended): progress 245-290 us/MiB (the copy), control receive,
parse and payload-receive posts 80-94 (UCX ``tag_recv`` 35-40 of it), payload landed 90-118 (xxh3 55-75,
the session server's ``on_frame`` 22-29); the sender 310 us/MiB: ``UcxConnection.send`` 130 (``encode``
74 with its xxh3 49, the payload's ``tag_send`` about 43), control flushes 25-29 (about one per two 1 MiB
blocks, ~50 us each), progress and reaps 40, the session's push coroutine and the loop about 115. One full
garbage collection of the bench's receiver child took 44 ms (its heap is not frozen, unlike the product's
actors, ``actors.worker.freeze_heap``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvloop

from actors.clock import Clock
from bench._common import emit, parser, pct
from bench._transport_baselines import (
    SENDER,
    UCX_TRANSPORTS,
    MiB,
    child_ucx_bare_sink,
    child_ucx_sink,
    ucx_address,
    ucx_bare_throughput,
    ucx_env,
    ucx_environment,
    ucx_unavailable,
)
from bench.transport import gbps, push_latency, push_throughput
from transport import TransportOptions
from transport.ucx_worker import SPIN_S, UcxWorker

HERE = Path(__file__).resolve()
_workers: list[ProfiledWorker] = []
"""Every ProfiledWorker this process created, in order."""


class ProfiledWorker(UcxWorker):
    """A UCX worker whose progress loop accounts its thread's CPU time and records each sleep (see the
    module docstring); otherwise the same loop as :meth:`UcxWorker._run` and :meth:`UcxWorker._sleep`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # its progress task first runs after this returns
        self.cpu = {"progress": 0.0, "callbacks": 0.0}
        self.cpu_start = time.thread_time()  # after creating the UCX context, which costs a fraction of a second
        self.sleep_ends: dict[str, list[float]] = {"fd": [], "post": [], "idle_poll": []}
        self.not_armed = 0
        _workers.append(self)

    def _progress(self) -> bool:  # the worker's own loop runs; its two steps are timed on this thread
        a = time.thread_time()
        reaped = self.cpu["callbacks"]
        try:
            return super()._progress()
        finally:  # the completions it reaped between steps count as callbacks, not progress
            self.cpu["progress"] += time.thread_time() - a - (self.cpu["callbacks"] - reaped)

    def _reap(self) -> bool:
        a = time.thread_time()
        try:
            return super()._reap()
        finally:
            self.cpu["callbacks"] += time.thread_time() - a

    async def _sleep(self) -> bool:
        t0 = time.perf_counter()
        slept = await super()._sleep()
        if not slept:
            self.not_armed += 1
            return False
        self.sleep_ends[self.woke_by].append((time.perf_counter() - t0) * 1e6)
        return True

    def report(self) -> dict[str, Any]:
        """CPU seconds of this thread since the worker started, by part, and each sleep's ending."""
        total = time.thread_time() - self.cpu_start
        return {"thread_cpu_s": round(total, 4), "progress_s": round(self.cpu["progress"], 4),
                "callbacks_s": round(self.cpu["callbacks"], 4),
                "rest_s": round(total - self.cpu["progress"] - self.cpu["callbacks"], 4),
                "spins": self.spins, "not_armed": self.not_armed,
                "sleeps": {k: pct(v) for k, v in self.sleep_ends.items()}}


def _install() -> None:
    """Make every UCX worker this process creates from now on a ProfiledWorker."""
    import transport.ucx
    import transport.ucx_worker

    transport.ucx.UcxWorker = ProfiledWorker  # type: ignore[misc]  # a measuring subclass, this process only
    transport.ucx_worker.UcxWorker = ProfiledWorker  # type: ignore[misc]


async def child(kind: str) -> None:
    """A receiver (``kv``: kvmesh's; ``bare``: the bare loop's) that prints its address, serves until its
    stdin closes, then prints its workers' reports as one JSON line."""
    _install()
    task = asyncio.ensure_future(child_ucx_sink() if kind == "kv" else child_ucx_bare_sink())
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    print(json.dumps([w.report() for w in _workers]), flush=True)
    task.cancel()


class Receiver:
    """This script as ``--child KIND`` in another process (see :func:`child`)."""

    def __init__(self, kind: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-u", str(HERE), "--child", kind], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert self.proc.stdout is not None
        self.location = self.proc.stdout.readline().strip()
        if not self.location:
            raise RuntimeError(f"receiver {kind} did not start")

    def report(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()  # the receiver reports, then stops
        line = self.proc.stdout.readline()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        reports: list[dict[str, Any]] = json.loads(line)
        return reports[0]


def per_mib(report: dict[str, Any], mib: int) -> dict[str, float]:
    """The receiver thread's CPU microseconds per MiB received, by part, and its idle spins per MiB."""
    return {k: round(report[f"{k}_s"] / mib * 1e6, 1) for k in ("thread_cpu", "progress", "callbacks", "rest")} | {
        "spins": round(report["spins"] / mib, 1)}


async def profile_over(tls: str, rounds: int, pings: int) -> dict[str, Any]:
    from transport.ucx import UcxTransport

    total = 64 * MiB
    env = ucx_env(tls)
    out: dict[str, Any] = {"tls": tls}
    with ucx_environment(env):
        bare = Receiver("bare", env)
        rates = [gbps(total, await ucx_bare_throughput(bare.location, total, 1)) for _ in range(rounds)]
        mib = rounds * 2 * total // MiB  # each call sends a warm-up round and a measured one
        out["bare_loop"] = {"gbps": rates, "receiver_us_per_mib": per_mib(bare.report(), mib)}
        kv = Receiver("kv", env)
        t = UcxTransport(SENDER, Clock(), TransportOptions(ucx_same_host="worker_address"))
        addr = ucx_address(kv.location)
        rates = [gbps(total, await push_throughput(t, addr, total, 1)) for _ in range(rounds)]
        out["kvmesh"] = {"gbps": rates, "receiver_us_per_mib": per_mib(kv.report(), mib)}
        kv = Receiver("kv", env)  # a fresh receiver and sender, so the sleep records hold only the pushes
        await t.close()
        t = UcxTransport(SENDER, Clock(), TransportOptions(ucx_same_host="worker_address"))
        addr = ucx_address(kv.location)
        lat = await push_latency(t, addr, 4096, pings)
        sender = _workers[-1].report()
        await t.close()
        out["push_4KiB"] = {"latency_us": pct(lat), "sender": sender, "receiver": kv.report()}
    b, k = out["bare_loop"]["receiver_us_per_mib"], out["kvmesh"]["receiver_us_per_mib"]
    print(f"ucx {tls}: bare loop {max(out['bare_loop']['gbps'])} GB/s, kvmesh {max(out['kvmesh']['gbps'])} GB/s; "
          f"receiver thread us/MiB bare {b}, kvmesh {k}")
    p = out["push_4KiB"]
    print(f"ucx {tls} 4 KiB push p50 {p['latency_us']['p50']} us; sleeps sender {p['sender']['sleeps']}, "
          f"receiver {p['receiver']['sleeps']}")
    return out


async def run(quick: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "transport_ucx_profile", "quick": quick, "spin_s": SPIN_S}
    skip = ucx_unavailable()
    if skip:
        result["skipped"] = skip
        return result
    _install()
    for name, tls in UCX_TRANSPORTS.items():
        result[name] = await profile_over(tls, 3 if quick else 8, 200 if quick else 1000)
    return result


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        uvloop.run(child(sys.argv[2]))
        return
    args = parser(__doc__ or "").parse_args()
    emit(uvloop.run(run(args.quick)))


if __name__ == "__main__":
    main()
