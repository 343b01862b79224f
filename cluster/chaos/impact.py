"""What each fault event did to the requests: failures, latency before/during/after, recovery time.

Pure functions over the client's records (emulated ms from the run start) and the schedule's events
(emulated s), so they are unit-tested without a cluster.

- Windows: ``before`` is the ``window_s`` before the event; ``during`` from the event to its end (an
  instantaneous event: the ``window_s`` after it); ``after`` the ``window_s`` after the end. A request
  belongs to the window its send time falls in.
- ``failed``: requests not ``ok`` whose life (send to terminal state) overlaps the event's span plus
  ``window_s``.
- Throughput is output tokens per emulated second, in ``bin_s`` bins, each request's tokens spread
  evenly from its first to its last token. ``recovery_s``: from the end of the event to the start of the
  first bin whose throughput is back to ``recovery_share`` (90%) of the mean over the ``before`` window;
  None when it never is within the run (or there was no throughput before).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cluster.chaos.schedule import Event
from cluster.loadtest.metrics import stats
from cluster.loadtest.record import RequestRecord


def token_throughput(records: Sequence[RequestRecord], bin_s: float, horizon_s: float) -> np.ndarray:
    """Output tokens per emulated second in bins of ``bin_s`` over ``[0, horizon_s)``."""
    n = max(1, int(np.ceil(horizon_s / bin_s)))
    tokens = np.zeros(n)
    for r in records:
        if r.ttft_ms is None or r.e2e_ms is None or r.output_tokens <= 0:
            continue
        first = (r.sent_ms + r.ttft_ms) / 1000.0
        last = (r.sent_ms + r.e2e_ms) / 1000.0
        times = np.linspace(first, last, r.output_tokens) if r.output_tokens > 1 else np.array([first])
        idx = np.clip((times // bin_s).astype(int), 0, n - 1)
        np.add.at(tokens, idx, 1.0)
    return tokens / bin_s


def _latency(records: Sequence[RequestRecord], lo_s: float, hi_s: float) -> dict[str, Any]:
    chosen = [r for r in records if lo_s * 1000.0 <= r.sent_ms < hi_s * 1000.0]
    ok = [r for r in chosen if r.success]
    return {"requests": len(chosen), "ok": len(ok),
            "ttft_ms": stats([r.ttft_ms for r in ok if r.ttft_ms is not None], (50, 99)),
            "tpot_ms": stats([t for r in ok if (t := r.tpot_ms) is not None], (50, 99))}


def event_impact(event: Event, index: int, records: Sequence[RequestRecord], *, window_s: float = 10.0,
                 bin_s: float = 1.0, recovery_share: float = 0.9) -> dict[str, Any]:
    """The figures of one event (see the module docstring)."""
    start, end = event.at_s, event.end_s()
    during_end = end if end > start else start + window_s
    horizon = max([during_end + window_s] + [(r.finished_ms or r.sent_ms) / 1000.0 for r in records])
    failed = [r for r in records if not r.success
              and r.sent_ms / 1000.0 <= during_end + window_s
              and (r.finished_ms if r.finished_ms is not None else r.sent_ms) / 1000.0 >= start]
    tput = token_throughput(records, bin_s, horizon)
    lo, hi = int(max(0.0, start - window_s) // bin_s), int(start // bin_s)
    baseline = float(tput[lo:hi].mean()) if hi > lo else 0.0
    recovery: float | None = None
    if baseline > 0:
        first_bin = int(np.ceil(end / bin_s))
        for b in range(first_bin, len(tput)):
            if tput[b] >= recovery_share * baseline:
                recovery = max(0.0, b * bin_s - end)
                break
    return {"index": index, "kind": event.kind, "at_s": start, "end_s": end,
            "event": event.model_dump(mode="json"),
            "failed": len(failed), "failed_ids": sorted(str(r.request_id) for r in failed),
            "before": _latency(records, max(0.0, start - window_s), start),
            "during": _latency(records, start, during_end),
            "after": _latency(records, during_end, during_end + window_s),
            "throughput_before_tok_s": baseline, "recovery_s": recovery}
