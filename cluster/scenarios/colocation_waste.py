"""``colocation-waste``: "20-40% of GPU time on the wrong resource", on the cost model's steady state.

A colocated engine at its operating point (``steady_mix.Mix``: the largest batch within the TPOT SLO)
runs mixed steps: the decodes are memory-bound, the prefill chunk compute-bound. The share of a mixed
step's time by which it exceeds the same decodes alone is time the decode batch (and the HBM bandwidth it
needs) waits on prefill compute: ``(mixed - decode alone) / mixed``. That is this scenario's reading of
"GPU time on the wrong resource"; the prefill chunk alone is given too.
"""

from __future__ import annotations

from typing import Any

from actors.cost_model import RooflineCostModel
from cluster.scenarios import Claim, Finding, Scenario, ScenarioContext, ScenarioResult, Verdict, register_scenario
from cluster.scenarios.steady_mix import Mix
from config import default_catalog

CLAIM = Claim("colocation-waste", "20-40% of GPU time on the wrong resource", "lessons-card.md",
              "Q&A: Colocation waste?")
MIXES = (Mix(512, 512, 30.0), Mix(1024, 512, 30.0), Mix(2048, 256, 30.0), Mix(4096, 256, 30.0),
         Mix(8192, 256, 40.0))
SETUPS = (("llama-3.1-8b", "h100-80g-sxm", 1), ("llama-3.1-70b", "h100-80g-sxm", 4))


def run(ctx: ScenarioContext) -> ScenarioResult:
    cat = default_catalog()
    rows: list[dict[str, Any]] = []
    for model, hw, tp in SETUPS:
        cost = RooflineCostModel(cat.hardware.get(hw), cat.models.get(model), tp)
        for m in MIXES:
            _, b = m.colocated_rate(cost)
            if b == 0:
                rows.append({"setup": f"{model} {hw} TP{tp}", "prompt": m.prompt, "output": m.output,
                             "batch": 0, "waste": None})
                continue
            mixed, dec, pre = m.colocated_step(cost, b)
            rows.append({"setup": f"{model} {hw} TP{tp}", "prompt": m.prompt, "output": m.output, "batch": b,
                         "mixed_ms": round(mixed, 2), "decode_alone_ms": round(dec, 2),
                         "prefill_alone_ms": round(pre, 2),
                         "waste": round((mixed - dec) / mixed, 3)})
    vals: list[float] = [r["waste"] for r in rows if r["waste"] is not None]
    inside = [v for v in vals if 0.2 <= v <= 0.4]
    fig = "; ".join(f"{r['setup']} {r['prompt']}/{r['output']} (batch {r['batch']}): "
                    + (f"{100 * r['waste']:.0f}%" if r["waste"] is not None else "no batch meets the SLO")
                    for r in rows)
    verdict = Verdict.HOLDS if len(inside) == len(vals) else Verdict.PARTLY if inside else Verdict.BREAKS
    cond = (f"{len(inside)} of {len(vals)} mixes fall in 20-40% (range {100 * min(vals):.0f}-{100 * max(vals):.0f}%); "
            "short prompts with long outputs waste less (little prefill per step), long prompts more")
    return ScenarioResult("colocation-waste", "cost model steady state (analytic)",
                          [Finding(CLAIM, fig, verdict, cond, value=round(sorted(vals)[len(vals) // 2], 3))],
                          {"rows": rows})


register_scenario(Scenario("colocation-waste", "share of a colocated engine's step time decodes wait on prefill",
                           run, (CLAIM,)))
