"""Load testing: trace readers, prompt synthesis, open/closed-loop replay, vLLM-standard metrics, reports.

Public API (see each module's docstring for the algorithm and failure behaviour):

- ``read_trace(path, fmt="auto", ReadOptions(block_size=..., strict=...)) -> TraceData``
- ``PromptSynthesizer(seed).prompt(spec) -> list[int]``
- ``run_loadtest(url, trace, LoadTestConfig(...)) -> LoadTestResult`` (async)
- ``replay_slice(url, trace=None, duration_s=30, max_requests=100) -> summary dict`` (blocking, prints)
- ``calculate_metrics(records, duration_s, slos) -> Metrics``
"""

from cluster.loadtest.client import ClientConfig, TargetError
from cluster.loadtest.formats import READERS, ReadOptions, detect_format, read_trace
from cluster.loadtest.metrics import calculate_metrics, max_rate_meeting_target, parse_slos
from cluster.loadtest.record import RequestRecord
from cluster.loadtest.replay import ReplayConfig
from cluster.loadtest.session import (
    LoadTestConfig,
    LoadTestResult,
    WorkloadSlice,
    default_demo_trace,
    print_result,
    replay_slice,
    run_loadtest,
    run_sync,
)
from cluster.loadtest.spec import RequestId, RequestSpec, TraceData, TraceError
from cluster.loadtest.synthesis import PromptSynthesizer, Vocabulary

__all__ = [
    "READERS",
    "ClientConfig",
    "LoadTestConfig",
    "LoadTestResult",
    "PromptSynthesizer",
    "ReadOptions",
    "ReplayConfig",
    "RequestId",
    "RequestRecord",
    "RequestSpec",
    "TargetError",
    "TraceData",
    "TraceError",
    "Vocabulary",
    "WorkloadSlice",
    "calculate_metrics",
    "default_demo_trace",
    "detect_format",
    "max_rate_meeting_target",
    "parse_slos",
    "print_result",
    "read_trace",
    "replay_slice",
    "run_loadtest",
    "run_sync",
]
