"""Routing policies rank candidates as documented; SGLang's cache_aware tree behaves as sgl-router's."""

from __future__ import annotations

import random

import pytest

from cluster.router.checks import check_router_spec, router_spec_problems
from cluster.router.policies import POLICIES, PolicyError, make_policy
from cluster.router.policies.sglang_cache_aware import ApproxTree
from cluster.router.regions import REGION_STRATEGIES, Topology, global_rank, regional_split
from cluster.router.view import Breaker, ClusterView, RequestContext, WorkerId, WorkerInfo
from config.cluster import RouterSpec


def workers(n: int = 3, region: str = "r") -> list[WorkerInfo]:
    return [WorkerInfo(WorkerId(f"w{i}"), f"http://w{i}", region=region, num_blocks=100, free_blocks=100)
            for i in range(n)]


def names(ws: list[WorkerInfo]) -> list[str]:
    return [w.name for w in ws]


def ctx(**kw: object) -> RequestContext:
    return RequestContext(**{"body": {}, **kw})  # type: ignore[arg-type]


def test_registry_holds_every_policy() -> None:
    for p in ("round_robin", "random", "least_loaded", "power_of_two", "session_affinity", "prefix_hash",
              "kv_aware", "sglang_cache_aware"):
        assert p in POLICIES
    with pytest.raises(PolicyError, match="unknown routing policy"):
        make_policy("nope")


def test_a_misspelt_or_invalid_parameter_is_an_error_naming_it() -> None:
    with pytest.raises(PolicyError, match="overlap_weigth"):
        make_policy("kv_aware", params={"overlap_weigth": 2})
    with pytest.raises(PolicyError, match="temperature"):
        make_policy("kv_aware", params={"temperature": -1})
    with pytest.raises(PolicyError, match="round_robin"):
        make_policy("round_robin", params={"anything": 1})
    assert make_policy("prefix_hash", params={"prefix_blocks": "3"}).blocks == 3  # type: ignore[attr-defined]


def test_router_spec_problems_name_the_field() -> None:
    ok = RouterSpec(policy="kv_aware", policy_params={"overlap_weight": 2})
    assert router_spec_problems(ok) == []
    bad = RouterSpec(policy="kv_aware", policy_params={"overlap_weigth": 2}, region_strategy="NEAREST")
    assert [path for path, _ in router_spec_problems(bad)] == ["router.policy_params", "router.region_strategy"]
    assert [path for path, _ in router_spec_problems(RouterSpec(policy="nope"))] == ["router.policy"]
    with pytest.raises(ValueError, match="overlap_weigth"):
        check_router_spec(bad)


def test_policies_and_strategies_say_whether_they_need_the_prefix() -> None:
    # sglang_cache_aware reads the request's text itself, as sgl-router does: no tokenizing.
    assert {n for n in POLICIES if make_policy(n).needs_prefix} == {"kv_aware", "prefix_hash"}
    topo = Topology()
    assert {n for n, f in REGION_STRATEGIES.items() if f(topo, lambda w, a, b: 0.0).needs_prefix} == {"GLOBAL"}


def test_round_robin_rotates() -> None:
    ws = workers()
    p = make_policy("round_robin")
    firsts = [p.rank(ws, ctx(), ClusterView(ws))[0].name for _ in range(4)]
    assert firsts == ["w0", "w1", "w2", "w0"]


def test_least_loaded_and_power_of_two() -> None:
    ws = workers(4)
    ws[0].inflight, ws[1].inflight, ws[2].inflight, ws[3].inflight = 5, 1, 3, 2
    assert names(make_policy("least_loaded").rank(ws, ctx(), ClusterView(ws))) == ["w1", "w3", "w2", "w0"]
    p2 = make_policy("power_of_two", random.Random(3))
    for _ in range(20):
        ranked = p2.rank(ws, ctx(), ClusterView(ws))
        assert ranked[0].name != "w0"  # the most loaded never wins a pair
        assert sorted(names(ranked)) == ["w0", "w1", "w2", "w3"]


def test_session_affinity_is_sticky_and_consistent() -> None:
    ws = workers(5)
    p = make_policy("session_affinity")
    chosen = {s: p.rank(ws, ctx(session_id=s), ClusterView(ws))[0].name for s in map(str, range(50))}
    assert all(p.rank(ws, ctx(session_id=s), ClusterView(ws))[0].name == w for s, w in chosen.items())
    fewer = [w for w in ws if w.name != "w2"]
    moved = [s for s, w in chosen.items() if p.rank(fewer, ctx(session_id=s), ClusterView(fewer))[0].name != w]
    assert all(chosen[s] == "w2" for s in moved)  # only the removed worker's sessions move


def test_prefix_hash_follows_the_first_blocks() -> None:
    ws = workers(4)
    p = make_policy("prefix_hash", params={"prefix_blocks": 2})
    a = p.rank(ws, ctx(block_hashes=[1, 2, 3]), ClusterView(ws))[0]
    b = p.rank(ws, ctx(block_hashes=[1, 2, 99, 100]), ClusterView(ws))[0]
    assert a is b


def test_prefix_hash_bounds_the_load_a_shared_prefix_brings() -> None:
    """Every request shares its first blocks: the hashed worker takes them until it holds 1.25 times its
    share, then the next worker in the ranking does; nobody ends with more than the bound."""
    ws = workers(4)
    p = make_policy("prefix_hash", params={"prefix_blocks": 2})
    view = ClusterView(ws)
    for _ in range(40):
        first = p.rank(ws, ctx(block_hashes=[1, 2, 3]), view)[0]
        first.inflight += 1
    loads = sorted(w.inflight for w in ws)
    assert sum(loads) == 40 and loads[-1] <= 13 and loads[0] >= 1  # bound ceil(1.25 x 40 / 4) = 13
    hashed = max(ws, key=lambda w: w.inflight)  # the worker the hash picks took the most
    pure = make_policy("prefix_hash", params={"prefix_blocks": 2, "load_factor": 0})
    assert pure.rank(ws, ctx(block_hashes=[1, 2, 3]), view)[0] is hashed  # unbounded: overloaded or not


def test_kv_aware_weighs_overlap_against_load() -> None:
    ws = workers(2)
    p = make_policy("kv_aware", params={"overlap_weight": 1.0, "duplicate_weight": 0.0})
    c = ctx(block_hashes=list(range(10)), overlap={WorkerId("w0"): 8, WorkerId("w1"): 0})
    assert p.rank(ws, c, ClusterView(ws))[0].name == "w0"
    ws[0].free_blocks = 70  # w0 now decodes 30 blocks: 2 to prefill + 30 > 10 + 0
    assert p.rank(ws, c, ClusterView(ws))[0].name == "w1"
    ws[0].free_blocks = 100
    ws[0].prefill_backlog_tokens = 16 * 7  # 7 blocks of queued prefill: 2 + 7 < 10, the hit still wins
    assert p.rank(ws, c, ClusterView(ws))[0].name == "w0"
    ws[0].prefill_backlog_tokens = 16 * 20  # a queue longer than the hit saves: 2 + 20 > 10
    assert p.rank(ws, c, ClusterView(ws))[0].name == "w1"
    p.on_routed(ws[1], c)
    assert ws[1].pending_blocks == 10
    ws[1].pending_blocks = 0
    # By default a queued prefill block weighs 8 decode blocks: 2 to prefill beats 10 despite 60 decoding.
    ws[0].prefill_backlog_tokens, ws[0].free_blocks = 0, 40
    assert make_policy("kv_aware", params={"duplicate_weight": 0.0}).rank(ws, c, ClusterView(ws))[0].name == "w0"
    assert p.rank(ws, c, ClusterView(ws))[0].name == "w1"  # at weight 1: 2 + 60 > 10
    ws[1].update_load({"free_blocks": 100, "num_blocks": 100, "prefill_backlog_tokens": 160}, 0.0)
    assert ws[1].pending_blocks == 0 and ws[1].prefill_backlog_tokens == 160  # the report now holds them


def test_kv_aware_prices_copying_a_cached_prefix_into_a_second_cache() -> None:
    ws = workers(2)
    c = ctx(block_hashes=list(range(136)), overlap={WorkerId("w0"): 128, WorkerId("w1"): 0})
    # w0 holds the prefix but still prefills one like it: 8 + 136 against 136 fresh blocks elsewhere.
    ws[0].prefilling_blocks = 136
    assert make_policy("kv_aware", params={"duplicate_weight": 0.0}).rank(ws, c, ClusterView(ws))[0].name == "w1"
    p = make_policy("kv_aware")
    assert p.rank(ws, c, ClusterView(ws))[0].name == "w0"  # + 8 x 128 for the copy: it stays
    ws[0].prefilling_blocks = 3 * 136  # a queue longer than the copy is worth: it moves
    assert p.rank(ws, c, ClusterView(ws))[0].name == "w1"


def test_kv_aware_counts_prompts_awaiting_their_first_token_when_the_report_misses_them() -> None:
    ws = workers(2)
    p = make_policy("kv_aware", params={"duplicate_weight": 0.0})
    c = ctx(block_hashes=list(range(10)), overlap={WorkerId("w0"): 4, WorkerId("w1"): 0})
    assert p.rank(ws, c, ClusterView(ws))[0].name == "w0"
    # A beat cleared w0's pending count before the engine had queued the 30 blocks the router sent it.
    ws[0].prefilling_blocks = 30
    assert p.rank(ws, c, ClusterView(ws))[0].name == "w1"
    # A report that shows more than the router's own count (another router's requests) wins.
    ws[0].prefilling_blocks, ws[1].prefilling_blocks = 0, 5
    ws[0].prefill_backlog_tokens = 16 * 10
    assert p.rank(ws, c, ClusterView(ws))[0].name == "w1"  # 6 + 10 > 10 + 5


def test_sglang_cache_aware_prefers_its_tree_then_balances() -> None:
    ws = workers(2)
    for w in ws:
        w.model = "m"
    p = make_policy("sglang_cache_aware", params={"balance_abs_threshold": 2, "balance_rel_threshold": 1.5})
    view = ClusterView(ws)
    c1 = ctx(body={"prompt": "a" * 100})
    first = p.rank(ws, c1, view)[0]
    assert first.name == "w0" and p.reason == "least_loaded"  # a miss, equal loads: the lowest name
    p.on_routed(first, c1)
    first.inflight = 1
    c2 = ctx(body={"prompt": "a" * 90 + "b" * 10})
    assert p.rank(ws, c2, view)[0] is first and p.reason == "cache_hit"  # even though it is busier
    c3 = ctx(body={"prompt": "a" * 20 + "c" * 80})  # 20% matched: not above 0.3
    other = p.rank(ws, c3, view)[0]
    assert other is not first and p.reason == "least_loaded"
    first.inflight = 10  # imbalanced: 10 - 0 > 2 and 10 > 1.5 x 0
    assert p.rank(ws, c2, view)[0] is not first and p.reason == "imbalanced"


def test_sglang_cache_aware_defaults_are_sgl_router_0_3_2s() -> None:
    from cluster.router.policies import check_policy

    assert check_policy("sglang_cache_aware").model_dump() == {
        "cache_threshold": 0.3, "balance_abs_threshold": 64, "balance_rel_threshold": 1.5,
        "max_tree_size": 2**26, "eviction_interval_s": 60.0}


def test_routing_text_is_what_sgl_router_extracts() -> None:
    from cluster.router.policies.sglang_cache_aware import routing_text

    assert routing_text(ctx(body={"prompt": "hi there"})) == "hi there"
    assert routing_text(ctx(body={"prompt": ["a b", "c"]})) == "a b c"
    assert routing_text(ctx(body={"prompt": [1, 22, 3]})) == "1 22 3"
    chat = {"messages": [{"role": "system", "content": "sys"},
                         {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]}
    assert routing_text(ctx(body=chat)) == "sys x y"


def test_approx_tree_split_match_counts_and_eviction_as_tree_rs() -> None:
    t = ApproxTree()
    t.insert("hello world", "a", 1.0)
    t.insert("hello there", "b", 2.0)
    assert t.prefix_match("hello world!", 3.0) == (11, "a")
    assert t.prefix_match("hello th", 4.0) == (8, "b")  # stops inside "there": b's node
    assert t.prefix_match("help", 5.0) == (3, "b")  # shared node "hello ": its most recently used tenant
    assert t.sizes == t.used_sizes() == {"a": 11, "b": 11}
    assert t.smallest_tenant() == "a"  # a tie: the lowest name
    t.insert("zzzz", "a", 6.0)
    assert t.sizes == t.used_sizes() and t.smallest_tenant() == "b"
    t.evict(max_size=6)  # a's least recently used leaf ("world", then "hello ") goes first
    assert t.sizes == t.used_sizes() and t.sizes["a"] <= 6 and t.prefix_match("zzzz", 7.0) == (4, "a")
    assert t.sizes["a"] == 4 and t.sizes["b"] == 6  # b was above 6 too: its leaf "there" went; "hello " stays
    t.remove_tenant("b")
    assert "b" not in t.sizes and t.prefix_match("hello th", 8.0)[1] != "b"


def test_approx_tree_sizes_stay_exact_under_random_inserts_and_evictions() -> None:
    rng = random.Random(3)
    t = ApproxTree()
    for k in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        t.insert(text, f"t{rng.randint(0, 3)}", float(k))
        if k % 50 == 49:
            t.evict(max_size=20)
            assert all(v <= 20 for v in t.sizes.values())
        assert t.sizes == {**dict.fromkeys(t.sizes, 0), **t.used_sizes()}


def test_sglang_cache_aware_evicts_on_the_clock() -> None:
    ws = workers(2)
    now = [0.0]
    view = ClusterView(ws, now=lambda: now[0])
    p = make_policy("sglang_cache_aware", params={"max_tree_size": 5, "eviction_interval_s": 60.0})
    for k in range(4):
        c = ctx(body={"prompt": f"{k}" * 10})
        p.on_routed(p.rank(ws, c, view)[0], c)
    assert max(p.tree.sizes.values()) > 5  # type: ignore[attr-defined]
    now[0] = 61.0
    p.rank(ws, ctx(body={"prompt": "x"}), view)
    assert max(p.tree.sizes.values()) <= 5  # type: ignore[attr-defined]


def test_global_rank_trades_prefill_for_distance() -> None:
    east, west = workers(1, "east")[0], workers(1, "west")[0]
    west.name = WorkerId("w-west")
    topo = Topology({("east", "west"): 65.0})
    c = ctx(prompt_ids=list(range(4000)), block_hashes=list(range(250)),
            overlap={WorkerId("w-west"): 250}, origin_region="east")
    # 4000 tokens at 0.2 ms each = 800 ms saved by the remote hit, against a 65 ms round trip.
    assert global_rank([east, west], c, topo, lambda w, new, cached: new * 0.2)[0] is west
    slow_rtt = Topology({("east", "west"): 2000.0})
    assert global_rank([east, west], c, slow_rtt, lambda w, new, cached: new * 0.2)[0] is east
    local, rest = regional_split([east, west], c, topo)
    assert local == [east] and rest == [west]


def test_breaker_opens_and_half_opens() -> None:
    b = Breaker(threshold=2, cooldown_s=5)
    assert not b.failure(0.0) and b.failure(1.0)
    assert not b.allows(2.0) and b.allows(6.5)
    b.success()
    assert b.state == "closed"


def test_kv_aware_breaks_near_ties_on_a_miss_by_the_blocks_each_worker_computed() -> None:
    # A new prefix makes its worker the prefix's home. w0 already computed two prefixes, w1 one; w1 is
    # finishing a decode (137 blocks in use, less than this request's footprint of 136 + 2 blocks).
    ws = [WorkerInfo(WorkerId(f"w{i}"), f"http://w{i}", num_blocks=1000, free_blocks=1000) for i in range(2)]
    p = make_policy("kv_aware")
    for w, prefix in ((ws[0], 1), (ws[0], 2), (ws[1], 3)):
        p.on_routed(w, ctx(block_hashes=[prefix * 1000 + i for i in range(136)], overlap={}))
    for w in ws:
        w.pending_blocks = 0
    ws[1].free_blocks = 1000 - 137
    miss = ctx(body={"max_tokens": 32}, block_hashes=list(range(136)), overlap={})
    assert names(make_policy("kv_aware").rank(ws, miss, ClusterView(ws))) == ["w0", "w1"]  # by cost alone
    assert names(p.rank(ws, miss, ClusterView(ws))) == ["w1", "w0"]  # near tie: w1 computed less
    assert names(make_policy("kv_aware", params={"near_tie_requests": 0}).rank(ws, miss, ClusterView(ws)))[0] == "w0"
    ws[1].free_blocks = 1000 - 139  # more than one request's footprint of decode: cost decides again
    assert names(p.rank(ws, miss, ClusterView(ws))) == ["w0", "w1"]
    # A hit is never traded for balance: the near tie needs the same overlap.
    ws[1].free_blocks = 1000
    hit = ctx(body={"max_tokens": 32}, block_hashes=list(range(136)), overlap={WorkerId("w0"): 128})
    assert names(p.rank(ws, hit, ClusterView(ws)))[0] == "w0"


def test_kv_aware_footprint_counts_prompt_and_max_tokens_blocks() -> None:
    from cluster.router.policies.kv_aware import footprint_blocks

    assert footprint_blocks(ctx(body={"max_tokens": 33}, block_hashes=list(range(10))), 16) == 13
    for bad in (None, "7", True, -1):
        assert footprint_blocks(ctx(body={"max_tokens": bad}, block_hashes=list(range(10))), 16) == 10
