"""What the client measured for one request, in emulated milliseconds from the start of the run."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from cluster.loadtest.spec import RequestId

Status = Literal["ok", "http_error", "timeout", "connection_error", "protocol_error", "no_content", "stalled"]
STATUSES: tuple[str, ...] = ("ok", "http_error", "timeout", "connection_error", "protocol_error", "no_content",
                             "stalled")


@dataclass(frozen=True)
class RequestRecord:
    """One request's timeline as vLLM's benchmark records it, converted to emulated ms.

    ``ttft_ms``: from the send to the first streamed chunk that carries a choice (content); ``e2e_ms``:
    from the send to the last such chunk; ``itl_ms``: the gap before every content chunk after the first
    (so ``len(itl_ms)`` is the number of content chunks minus one). ``output_tokens`` is the usage
    block's ``completion_tokens`` when the server sends one, else the number of content chunks.
    A request is successful (``status == "ok"``) when the response was HTTP 200 and had at least one
    content chunk; then ``ttft_ms`` and ``e2e_ms`` are set.
    """

    request_id: RequestId
    status: Status
    scheduled_ms: float
    """When the schedule said to send it (emulated ms from the run start)."""
    sent_ms: float
    """When the client really started sending it."""
    input_len: int
    expected_output_len: int
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    http_status: int | None = None
    error: str = ""
    worker: str | None = None
    session_id: str | None = None
    send_lag_wall_ms: float = 0.0
    """How late the send really was against its schedule, in wall ms (the replayer's own accuracy)."""
    finished_ms: float | None = None
    """When the client saw the request's terminal state (emulated ms from the run start)."""
    deadline_ms: float | None = None
    """The latest the terminal state may come: the send plus the client's request timeout."""
    residency: str | None = None
    """The residency region the request was tagged with (the history checker's residency check)."""
    token_ids: tuple[int, ...] = ()
    """The token ids as the client received them, in order (only with ``ClientConfig.record_tokens``)."""
    prompt_ids: tuple[int, ...] = ()
    """The prompt sent (only with ``ClientConfig.record_tokens``): the checker regenerates the engines'
    tokens from it."""

    @property
    def success(self) -> bool:
        return self.status == "ok"

    @property
    def tpot_ms(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), only for successful requests with more than one token."""
        if not self.success or self.output_tokens <= 1 or self.e2e_ms is None or self.ttft_ms is None:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    @property
    def end_ms(self) -> float | None:
        return None if self.e2e_ms is None else self.sent_ms + self.e2e_ms

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["itl_ms"] = [round(x, 4) for x in self.itl_ms]
        d["tpot_ms"] = self.tpot_ms
        for name in ("token_ids", "prompt_ids"):  # only recorded on request: keep other runs' files small
            if not d[name]:
                del d[name]
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> RequestRecord:
        fields = {k: v for k, v in d.items() if k in RequestRecord.__dataclass_fields__}
        for name in ("itl_ms", "token_ids", "prompt_ids"):
            fields[name] = tuple(fields.get(name) or ())
        fields["request_id"] = RequestId(str(fields["request_id"]))
        return RequestRecord(**fields)
