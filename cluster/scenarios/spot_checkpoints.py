"""``spot-checkpoints``: spot decode nodes checkpoint each sequence's KV to CPU memory every 32 tokens.

kvmesh's mechanism: ``router.kv_migration.checkpoints`` (``checkpoint_every_tokens: 32``): the engine
copies each sequence's new KV blocks to a peer every 32 generated tokens, and a stream whose engine is
killed without notice resumes there (``tests/chaos/test_migration.py``). This scenario prices it on the
cost model and the link model: one checkpoint of 32 tokens' KV (incremental) and of the whole context
over PCIe Gen4 (to CPU memory) for Llama-3.1-70B (BF16 KV) and the card's 70B FP8, against the decode
time of those 32 tokens; and what a preemption costs with and without the checkpoint (re-prefilling the
context vs re-decoding at most 32 tokens).
"""

from __future__ import annotations

from typing import Any

from actors.cost_model import RooflineCostModel, decode_ms, prefill_ms
from cluster.scenarios import Claim, Finding, Scenario, ScenarioContext, ScenarioResult, Verdict, register_scenario
from config import default_catalog

CLAIM = Claim("spot-checkpoint-32", "checkpointing KV cache to CPU memory every 32 tokens. Overhead is ~2ms per "
              "checkpoint.", "practitioners-guide.md", "FAQ: Can I run disaggregated inference on spot instances?")
EVERY = 32
CONTEXTS = (1024, 4096, 16384)


def run(ctx: ScenarioContext) -> ScenarioResult:
    cat = default_catalog()
    pcie = cat.links.get("pcie-gen4")
    cost = RooflineCostModel(cat.hardware.get("h100-80g-sxm"), cat.models.get("llama-3.1-70b"), 4)
    kvs = {"llama-3.1-70b (BF16 KV)": cost.kv_bytes_per_token,
           "lessons 70B FP8": cat.profiles.get("lesson-70b-fp8").kv_bytes_per_token}
    rows: list[dict[str, Any]] = []
    for label, kv in kvs.items():
        for c in CONTEXTS:
            inc = pcie.transfer_ms(EVERY * kv)
            full = pcie.transfer_ms(c * kv)
            dec32 = decode_ms(cost, c, EVERY)
            lost_without = prefill_ms(cost, c, 8192)  # no checkpoint: the new engine re-prefills the whole context
            rows.append({"kv": label, "context": c, "incremental_ms": round(inc, 3), "full_copy_ms": round(full, 2),
                         "decode_32_ms": round(dec32, 1), "overhead_incremental": round(inc / dec32, 4),
                         "recovery_without_ms": round(lost_without, 1), "recovery_with_ms": round(dec32, 1)})
    inc_ms = [r["incremental_ms"] for r in rows]
    fig = "; ".join(f"{r['kv']} @ {r['context']}: {r['incremental_ms']:.2f} ms incremental "
                    f"({100 * r['overhead_incremental']:.2f}% of 32 decode steps), {r['full_copy_ms']:.0f} ms full"
                    for r in rows)
    verdict = Verdict.HOLDS if all(0.5 <= x <= 4 for x in inc_ms) else Verdict.BREAKS
    cond = ("over PCIe Gen4 (32 GB/s) an incremental checkpoint of 32 tokens' KV takes 0.1-0.4 ms, well under ~2 ms; "
            "~2 ms is what a checkpoint costs with the per-transfer set-up of a network or a copy of a few hundred "
            "tokens; a full-context copy every 32 tokens costs 20-170 ms and would not be worth it")
    return ScenarioResult("spot-checkpoints", "cost model + link model (analytic); the mechanism itself is tested "
                          "live (tests/chaos/test_migration.py)",
                          [Finding(CLAIM, fig, verdict, cond, value=max(inc_ms))],
                          {"every_tokens": EVERY, "rows": rows})


register_scenario(Scenario("spot-checkpoints", "KV checkpoints every 32 tokens: cost per checkpoint and what a "
                           "preemption saves", run, (CLAIM,)))
