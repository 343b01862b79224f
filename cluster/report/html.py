"""Render a run folder as one self-contained HTML page (``report.html`` in the folder).

What a folder may hold, and what the page shows for it:

- ``summary.json`` (a load test; a sweep's has ``runs`` and ``rate-*/`` sub-folders): the summary table
  (one column per run: requests, throughput, TTFT/TPOT/ITL/E2E mean, p50 and p99, step lag), and the run's
  notes;
- ``scenarios.json`` (``scenario run ... --out``): the claim-against-result table (claim and its source,
  the emulated figure, the verdict, when it holds or breaks, what is missing) and a per-scenario table
  (method, wall time, step lag);
- every ``*.png`` in the folder and its sub-folders: embedded as base64 ``<img>`` (no external file, no
  script, no network: the page reads the same offline, from a mail attachment or an archive).

Step-lag flags: a run whose step lag p99 exceeds its threshold (``step_lag_threshold_ms``, 10 ms unless the
summary names another), whose summary says ``trustworthy: false``, or a scenario marked ``lagging``, gets
a red flag beside its figures and a banner at the top: such a figure was produced by an emulator that
could not keep its own clock and should not be trusted.

Failure behaviour: a folder with none of these files raises ``ReportError`` naming the folder; an
unreadable JSON file raises it naming the file.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPORT_FILE = "report.html"
LAG_THRESHOLD_MS = 10.0


class ReportError(ValueError):
    """The folder holds nothing to report, or a file in it cannot be read."""


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: cannot read ({e})") from e


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1e6 else f"{v:,.0f}"
    return str(v)


def _e(v: Any) -> str:
    return html.escape(_fmt(v))


def _runs(summary: Mapping[str, Any], folder: Path) -> list[tuple[str, Mapping[str, Any]]]:
    """(label, summary) of each run: a sweep's sub-runs by rate, else the one run."""
    subs = summary.get("runs")
    if isinstance(subs, list) and subs:
        return [(f"rate {r.get('rate')}", r) for r in subs if isinstance(r, Mapping)]
    return [(str(summary.get("name") or folder.name), summary)]


def lag_over(run: Mapping[str, Any]) -> bool:
    """Whether the run's step lag p99 passed its threshold."""
    p99 = _get(run, ("step_lag_ms", "p99"))
    return p99 is not None and float(p99) > float(run.get("step_lag_threshold_ms") or LAG_THRESHOLD_MS)


def lagging(run: Mapping[str, Any]) -> str | None:
    """Why this run's figures are untrustworthy (step lag or the summary's own flag), or None."""
    lag = run.get("step_lag_ms") if isinstance(run.get("step_lag_ms"), Mapping) else {}
    limit = float(run.get("step_lag_threshold_ms") or LAG_THRESHOLD_MS)
    p99 = lag.get("p99") if isinstance(lag, Mapping) else None
    if p99 is not None and float(p99) > limit:
        behind = run.get("engines_behind") or []
        extra = f" (engines behind: {', '.join(map(str, behind))})" if behind else ""
        return f"step lag p99 {float(p99):.2f} ms > {limit:g} ms{extra}"
    if run.get("trustworthy") is False:
        return "; ".join(str(n) for n in run.get("notes") or []) or "the summary marks it untrustworthy"
    return None


SUMMARY_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("requests", ("requests",)), ("completed", ("completed",)), ("failed", ("failed",)),
    ("request throughput (req/s)", ("request_throughput",)), ("output tokens/s", ("output_throughput",)),
    ("TTFT mean (ms)", ("ttft_ms", "mean")), ("TTFT p50 (ms)", ("ttft_ms", "p50")),
    ("TTFT p99 (ms)", ("ttft_ms", "p99")),
    ("TPOT mean (ms)", ("tpot_ms", "mean")), ("TPOT p99 (ms)", ("tpot_ms", "p99")),
    ("ITL p50 (ms)", ("itl_ms", "p50")), ("ITL p99 (ms)", ("itl_ms", "p99")),
    ("E2E mean (ms)", ("e2e_ms", "mean")), ("E2E p99 (ms)", ("e2e_ms", "p99")),
    ("SLO attainment", ("slo_attainment",)), ("prefix hit ratio", ("prefix_hit_ratio",)),
    ("step lag p50 (ms)", ("step_lag_ms", "p50")), ("step lag p99 (ms)", ("step_lag_ms", "p99")),
    ("step lag max (ms)", ("step_lag_ms", "max")), ("time scale", ("time_scale",)),
)


def _get(d: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = d
    for k in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(k)
    return cur


def summary_section(summary: Mapping[str, Any], folder: Path) -> tuple[str, list[str]]:
    runs = _runs(summary, folder)
    flags = [f"{label}: {why}" for label, r in runs if (why := lagging(r))]
    head = "".join(f"<th>{html.escape(label)}{' <span class=flag>untrusted</span>' if lagging(r) else ''}</th>"
                   for label, r in runs)
    body = "".join(f"<tr><th scope=row>{html.escape(name)}</th>"
                   + "".join(f"<td class={'bad' if name.startswith('step lag p99') and lag_over(r) else 'num'}>"
                             f"{_e(_get(r, path))}</td>" for _, r in runs) + "</tr>"
                   for name, path in SUMMARY_ROWS)
    notes = [str(n) for _, r in runs for n in (r.get("notes") or [])]
    note_html = ("<h3>Notes</h3><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>") if notes else ""
    return (f"<h2>Summary</h2><table id=summary><thead><tr><th>figure</th>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table>{note_html}"), flags


def claims_section(doc: Mapping[str, Any]) -> tuple[str, list[str]]:
    rows = []
    for c in doc.get("claims", []):
        v = str(c.get("verdict"))
        rows.append(f"<tr><td>{_e(c.get('scenario'))}</td><td><q>{_e(c.get('text'))}</q><br><small>"
                    f"{_e(c.get('source'))}</small></td><td>{_e(c.get('figure'))}</td>"
                    f"<td class='verdict {v.replace(' ', '-')}'>{_e(v)}</td><td>{_e(c.get('conditions'))}"
                    + (f"<br><small>missing: {_e(c.get('missing'))}</small>" if c.get("missing") else "")
                    + "</td></tr>")
    flags = []
    srows = []
    for s in doc.get("scenarios", []):
        lag = s.get("step_lag_p99_ms")
        bad = bool(s.get("lagging")) or (lag is not None and float(lag) > LAG_THRESHOLD_MS)
        if bad:
            flags.append(f"scenario {s.get('scenario')}: step lag p99 {_fmt(lag)} ms")
        srows.append(f"<tr><td>{_e(s.get('scenario'))}</td><td>{_e(s.get('method'))}</td>"
                     f"<td class=num>{_e(s.get('wall_s'))}</td><td class={'bad' if bad else 'num'}>{_e(lag)}"
                     f"{' <span class=flag>lagging</span>' if bad else ''}</td></tr>")
    counts = ", ".join(f"{k}: {v}" for k, v in (doc.get("verdicts") or {}).items())
    return (f"<h2>Claims against the emulator</h2><p>{html.escape(counts)}</p><table id=claims><thead><tr>"
            "<th>scenario</th><th>claim (source)</th><th>emulated</th><th>verdict</th><th>conditions</th></tr>"
            f"</thead><tbody>{''.join(rows)}</tbody></table><h2>Scenarios</h2><table id=scenarios><thead><tr>"
            "<th>scenario</th><th>method</th><th>wall s</th><th>step lag p99 (ms)</th></tr></thead>"
            f"<tbody>{''.join(srows)}</tbody></table>"), flags


def plots_section(folder: Path) -> str:
    imgs = []
    for p in sorted(folder.rglob("*.png")):
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        rel = p.relative_to(folder).as_posix()
        imgs.append(f"<figure><img alt='{html.escape(rel)}' src='data:image/png;base64,{data}'>"
                    f"<figcaption>{html.escape(rel)}</figcaption></figure>")
    return f"<h2>Plots</h2><div class=plots>{''.join(imgs)}</div>" if imgs else ""


CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}td.num{text-align:right}
td.bad{background:#fdd;text-align:right}.flag{color:#fff;background:#c00;border-radius:3px;padding:0 4px;font-size:11px}
.banner{background:#fee;border:1px solid #c00;padding:.5em 1em}.verdict{font-weight:bold}.holds{color:#070}
.breaks{color:#b00}.partly{color:#a60}.not-run{color:#777}.plots{display:flex;flex-wrap:wrap;gap:1em}
figure{margin:0}img{max-width:560px;border:1px solid #ddd}small{color:#666}"""


def render(folder: Path) -> str:
    """The page for ``folder`` (see the module docstring)."""
    if not folder.is_dir():
        raise ReportError(f"{folder}: not a folder")
    parts: list[str] = []
    flags: list[str] = []
    title = folder.name
    if (folder / "summary.json").is_file():
        summary = _load(folder / "summary.json")
        title = str(summary.get("name") or title)
        s, f = summary_section(summary, folder)
        parts.append(s)
        flags += f
    if (folder / "scenarios.json").is_file():
        s, f = claims_section(_load(folder / "scenarios.json"))
        parts.append(s)
        flags += f
    if not parts:
        raise ReportError(f"{folder}: no summary.json or scenarios.json to report")
    parts.append(plots_section(folder))
    banner = ("<div class=banner id=lag-flags><b>Untrustworthy figures</b> (step lag: the emulator could not keep its "
              "clock; or the load generator or the real transport fell behind):<ul>"
              + "".join(f"<li>{html.escape(x)}</li>" for x in flags) + "</ul></div>") if flags else ""
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>kvmesh: {html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>kvmesh report: {html.escape(title)}</h1>"
            f"<p><small>{html.escape(str(folder))}</small></p>{banner}{''.join(parts)}</body></html>")


def write_report(folder: Path) -> Path:
    out = folder / REPORT_FILE
    out.write_text(render(folder), encoding="utf-8")
    return out
