"""The disagg-crossover scenario's isolated rows against the analytic estimate (a few rows; all in the CLI)."""

from __future__ import annotations

from cluster.scenarios import disagg_crossover


def test_isolated_requests_match_the_estimate(ray_cluster: object) -> None:
    # A short prompt (re-run on the fine clock) and a long one: the two regimes the estimate's terms cover.
    # The CLI sweeps the prompts between; 8192 was dropped here to keep the suite inside its budget.
    plan = disagg_crossover.Plan(prompts=(512, 16384), output=64, rates=(), ucx=False)
    result = disagg_crossover.run(plan=plan, profiles=("lesson-70b-fp8",))
    rows = result["profiles"][0]["rows"]
    assert {r["mode"] for r in rows} == {"colocated", "rdma", "tcp", "tcp-pull"}
    for r in rows:
        # Every row within 5%: end-to-end from the run at time scale 5; TTFT and transfer of the short rows
        # from a run at time scale 100, where the real HTTP hops shrink to a hundredth in emulated time.
        # A transfer under 2 ms may also be off by 0.1 ms (what a real hop still adds there). The transfer is
        # read from the first inter-token gap; on rows run at time scale 5 the first token's real HTTP hop
        # (which shows as TTFT above the estimate) shortens that gap by up to as much, so it is allowed too.
        assert abs(r["error"]["e2e_ms"]) <= 0.05, r
        assert abs(r["error"]["ttft_ms"]) <= 0.05, r
        pred, got = r["predicted"]["transfer_ms"], r["measured"]["transfer_ms"]
        hop = max(0.0, r["measured"]["ttft_ms"] - r["predicted"]["ttft_ms"]) if r["ttft_time_scale"] < 100 else 0.0
        assert abs(got - pred) <= max(0.05 * pred, 0.1) + hop, r
    assert {r["ttft_time_scale"] for r in rows if r["prompt"] == 512} == {100.0}
    # Over the lessons card's links, disaggregation wins at every swept prompt at this output length.
    colo = {r["prompt"]: r["measured"]["e2e_ms"] for r in rows if r["mode"] == "colocated"}
    for r in rows:
        if r["mode"] != "colocated":
            assert r["measured"]["e2e_ms"] < colo[r["prompt"]]
