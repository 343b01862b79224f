"""The HTML report of a run folder: summary table, claims table, embedded plots, step-lag flags; offline."""

from __future__ import annotations

import json
import struct
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from cluster.report.html import ReportError, render, write_report
from run_cluster import main


def tiny_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def run_folder(root: Path, lag_p99: float) -> Path:
    root.mkdir()
    run = {"requests": 10, "completed": 10, "failed": 0, "ttft_ms": {"mean": 12.5, "p50": 11.0, "p99": 30.0},
           "tpot_ms": {"mean": 7.0, "p99": 8.0}, "step_lag_ms": {"p50": 0.1, "p99": lag_p99, "max": 40.0},
           "notes": ["block size inferred"]}
    (root / "summary.json").write_text(json.dumps({"name": "t", "runs": [{**run, "rate": 1.0}, {**run, "rate": 2.0}]}))
    (root / "scenarios.json").write_text(json.dumps({
        "claims": [{"scenario": "hogwild", "claim": "k", "text": "1.8x at p = 0.7, N = 4", "source": "card: x",
                    "figure": "1.62x <b>", "value": 1.62, "verdict": "holds", "conditions": "c", "missing": None}],
        "verdicts": {"holds": 1},
        "scenarios": [{"scenario": "hogwild", "method": "m", "wall_s": 0.4, "step_lag_p99_ms": None}]}))
    (root / "ttft_cdf.png").write_bytes(tiny_png())
    (root / "rate-1.0").mkdir()
    (root / "rate-1.0" / "tpot_cdf.png").write_bytes(tiny_png())
    return root


def test_page_holds_tables_plots_and_flags(tmp_path: Path) -> None:
    page = render(run_folder(tmp_path / "run", lag_p99=25.0))
    p = Tags()
    p.feed(page)
    ids = {a.get("id") for t, a in p.tags if t == "table"}
    assert ids == {"summary", "claims", "scenarios"}
    imgs = [a["src"] for t, a in p.tags if t == "img"]
    assert len(imgs) == 2 and all(s and s.startswith("data:image/png;base64,") for s in imgs)
    assert not [a for t, a in p.tags if t in ("script", "link")]  # nothing fetched: readable offline
    assert "step lag p99 25.00 ms &gt; 10 ms" in page and "id=lag-flags" in page
    assert "1.62x &lt;b&gt;" in page  # figures are escaped


def test_no_flag_when_the_emulator_kept_up(tmp_path: Path) -> None:
    page = render(run_folder(tmp_path / "run", lag_p99=2.0))
    assert "lag-flags" not in page and "lagging" not in page


def test_cli_writes_report_and_refuses_an_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = run_folder(tmp_path / "run", lag_p99=1.0)
    assert main(["report", str(folder)]) == 0
    assert (folder / "report.html").read_text().startswith("<!doctype html>")
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "no summary.json or scenarios.json" in capsys.readouterr().out
    with pytest.raises(ReportError):
        write_report(tmp_path / "missing")
