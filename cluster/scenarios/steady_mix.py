"""The steady-state serving mix on the cost model, shared by ``small-cluster`` and ``colocation-waste``.

A workload of ``prompt`` -> ``output`` tokens under a TPOT SLO. In the steady state of a colocated engine
running ``B`` requests, each step decodes ``B`` tokens and, to keep up with arrivals, prefills
``B x prompt / output`` prompt tokens (chunked prefill mixes them into the step). The step time is the
cost model's for that mixed batch; the TPOT is that step time; the engine completes
``B / (output x step)`` requests per ms. A prefill engine completes ``1 / prefill(prompt)``; a decode
engine running ``B`` decodes completes ``B / (output x step(B decodes))``, each at the largest ``B``
whose step fits the SLO (and the KV capacity is not modelled: the figures are compute/bandwidth bounds).

Failure behaviour: a workload no batch can serve within the SLO gives a capacity of 0 (not an error).
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.cost_model import CostModel, StepShape, prefill_ms

BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class Mix:
    prompt: int
    output: int
    tpot_slo_ms: float

    def colocated_step(self, cost: CostModel, b: int) -> tuple[float, float, float]:
        """(mixed step ms, the same decodes alone, the same prefill tokens alone) at batch ``b``."""
        ctx = self.prompt + self.output // 2
        k = max(1, round(b * self.prompt / self.output))
        mixed = cost.step(StepShape.of(prefills=[(k, 0)], decodes=[ctx] * b)).total_ms
        dec = cost.step(StepShape.of(decodes=[ctx] * b)).total_ms
        pre = cost.step(StepShape.of(prefills=[(k, 0)])).total_ms
        return mixed, dec, pre

    def colocated_rate(self, cost: CostModel) -> tuple[float, int]:
        """(requests per second of one colocated engine within the SLO, its batch)."""
        best = (0.0, 0)
        for b in BATCHES:
            step = self.colocated_step(cost, b)[0]
            if step <= self.tpot_slo_ms:
                best = max(best, (1000.0 * b / (self.output * step), b))
        return best

    def decode_rate(self, cost: CostModel) -> tuple[float, int]:
        ctx = self.prompt + self.output // 2
        best = (0.0, 0)
        for b in BATCHES:
            step = cost.step(StepShape.of(decodes=[ctx] * b)).total_ms
            if step <= self.tpot_slo_ms:
                best = max(best, (1000.0 * b / (self.output * step), b))
        return best

    def prefill_rate(self, cost: CostModel, chunk: int = 8192) -> float:
        return 1000.0 / prefill_ms(cost, self.prompt, chunk)

    def best_split(self, cost: CostModel, gpus: int) -> tuple[float, int, int]:
        """(requests per second, P, D) of the best xPyD split of ``gpus`` one-GPU engines."""
        pr, dr = self.prefill_rate(cost), self.decode_rate(cost)[0]
        return max(((min(p * pr, (gpus - p) * dr), p, gpus - p) for p in range(1, gpus)), default=(0.0, 0, 0))
