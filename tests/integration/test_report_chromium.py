"""The HTML report as a browser renders it: headless Chromium loads the page from disk (offline) and its
DOM holds the three tables and every plot as an inline image; a screenshot is taken."""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from cluster.report.html import write_report
from tests.unit.test_report_html import run_folder


def chromium() -> str:
    """The Chromium binary; installed with apt-get when missing (as root), else the test is skipped."""
    for name in ("chromium", "chromium-browser"):
        if (path := shutil.which(name)) is not None:
            return path
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and cannot be installed here (needs root and apt-get)")
    r = subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True, text=True, timeout=900)
    path = shutil.which("chromium")
    if r.returncode != 0 or path is None:
        pytest.skip(f"apt-get install chromium failed: {r.stderr[-300:]}")
    return path


class Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tables: list[str | None] = []
        self.imgs: list[str | None] = []
        self.rows = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self.tables.append(a.get("id"))
        elif tag == "img":
            self.imgs.append(a.get("src"))
        elif tag == "tr":
            self.rows += 1


def test_chromium_renders_tables_and_images(tmp_path: Path) -> None:
    exe = chromium()
    page = write_report(run_folder(tmp_path / "run", lag_p99=25.0))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([exe, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-500:]
    d = Dom()
    d.feed(dom.stdout)
    assert sorted(t or "" for t in d.tables) == ["claims", "scenarios", "summary"]
    assert len(d.imgs) == 2 and all((s or "").startswith("data:image/png;base64,") for s in d.imgs)
    assert d.rows > 20
    shot = tmp_path / "report.png"
    r = subprocess.run([exe, *flags, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-500:]
