"""``small-cluster``: "disaggregation loses on small clusters (< 4 GPUs)", on the cost model's steady state.

For G one-GPU engines of Llama-3.1-8B on H100 (the roofline cost model), the colocated fleet's request rate
within a TPOT SLO (``steady_mix.Mix``) against the best xPyD split of the same G GPUs, for G = 2, 3, 4, 8
and a few prompt/output mixes and SLOs. With few GPUs the split is coarse (1P1D is the only choice at 2),
so one pool idles while the other saturates.
"""

from __future__ import annotations

from typing import Any

from actors.cost_model import RooflineCostModel
from cluster.scenarios import Claim, Finding, Scenario, ScenarioContext, ScenarioResult, Verdict, register_scenario
from cluster.scenarios.steady_mix import Mix
from config import default_catalog

CLAIM = Claim("disagg-small-cluster", "Small cluster (< 4 GPUs)", "lessons-card.md",
              "Four methods side by side: Disaggregation loses when")
GPUS = (2, 3, 4, 8)
MIXES = (Mix(2048, 256, 30.0), Mix(4096, 256, 30.0), Mix(1024, 512, 25.0), Mix(2048, 256, 12.0))


def run(ctx: ScenarioContext) -> ScenarioResult:
    cat = default_catalog()
    cost = RooflineCostModel(cat.hardware.get("h100-80g-sxm"), cat.models.get("llama-3.1-8b"), 1)
    rows: list[dict[str, Any]] = []
    for m in MIXES:
        colo, b = m.colocated_rate(cost)
        for g in GPUS:
            rate, p, d = m.best_split(cost, g)
            rows.append({"prompt": m.prompt, "output": m.output, "tpot_slo_ms": m.tpot_slo_ms, "gpus": g,
                         "colocated_rps": round(g * colo, 2), "colocated_batch": b, "disagg_rps": round(rate, 2),
                         "split": f"{p}P{d}D", "ratio": round(rate / (g * colo), 3) if colo > 0 else None})
    small = [r for r in rows if r["gpus"] < 4]
    large = [r for r in rows if r["gpus"] >= 4]
    loses_small = all(r["ratio"] is not None and r["ratio"] < 1 for r in small)
    wins_large = [r for r in large if r["ratio"] is None or r["ratio"] >= 1]
    fig = "; ".join(f"{m.prompt}/{m.output} SLO {m.tpot_slo_ms:g} ms: "
                    + ", ".join(f"{r['gpus']} GPUs {r['split']} {r['ratio']}x" for r in rows
                                if (r["prompt"], r["output"], r["tpot_slo_ms"]) == (m.prompt, m.output, m.tpot_slo_ms))
                    for m in MIXES)
    verdict = (Verdict.HOLDS if loses_small and wins_large else Verdict.PARTLY if loses_small else Verdict.BREAKS)
    cond = ("disaggregated/colocated request rate on the same GPUs (below 1: disaggregation loses). It loses below 4 "
            "GPUs in every mix; at 4 and 8 GPUs it wins only where the colocated engine's mixed steps cannot meet the "
            "TPOT SLO at a useful batch (tight SLO), since on identical GPUs the roofline's mixed steps batch well; "
            "the gains the card reports come from interference, cheaper decode GPUs and a P:D ratio fitted at scale")
    return ScenarioResult("small-cluster", "cost model steady state (analytic, Llama-3.1-8B on H100)",
                          [Finding(CLAIM, fig, verdict, cond,
                                   value=max((r["ratio"] or 0.0) for r in small))], {"rows": rows})


register_scenario(Scenario("small-cluster", "colocated vs the best xPyD split of 2, 3, 4 and 8 GPUs under a TPOT SLO",
                           run, (CLAIM,)))
