"""SGLang router's ``cache_aware`` policy, re-implemented faithfully as a baseline (sgl-router 0.3.2).

sgl-router (``src/policies/cache_aware.rs``, ``src/policies/tree.rs``; 0.3.2 is built as sgl-model-gateway)
keeps an *approximate* radix tree of the request texts it routed, character by character, one tenant per
worker, and knows nothing of what the engines really cache. For each request:

1. ``loads`` are the requests the router has open on every worker (healthy or not). The load is
   *imbalanced* when ``max - min > balance_abs_threshold`` and ``max > min x balance_rel_threshold``: the
   request goes to the least loaded eligible worker, and its text is still inserted under that worker.
2. Otherwise ``prefix_match(text)`` walks the tree as deep as the text matches (stopping inside a node
   on a partial match) and names a tenant of the node where it stopped. If ``matched chars / text chars >
   cache_threshold`` the request goes to that tenant, else to the least loaded eligible worker (0.3.2; the
   older routers took the tenant with the smallest tree). The text is inserted under the chosen worker. A
   matched tenant that is not an eligible worker any more: the first eligible worker serves (no insert).
3. Every ``eviction_interval_s`` (a timer in sgl-router; here checked on the passed clock at the next
   request, which is when a decision could first see it) each tenant above ``max_tree_size`` characters
   loses its least recently used leaves until it fits.

The routing text is what sgl-router extracts: a completion's prompt string (a list of strings joined by
spaces; token ids as decimal numbers joined by spaces, as for its ``/generate``), a chat's message contents
joined by spaces. Defaults are 0.3.2's (``router_args.py``): cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5, eviction every 60 s, max_tree_size 2**26.

Tie-breaks. sgl-router takes the *first* least loaded worker in its worker list (an order of its own), and a
shared node's tenant is the first in a hash map with a per-process random seed (arbitrary, run to run); here
the least loaded worker's ties go to the lowest name and a shared node's to its most recently used tenant
(then the lowest name). Comparisons with the real router are therefore made up to a renaming of workers
(see ``tests/integration/test_sglang_agreement.py``).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from typing import Any

from pydantic import Field

from cluster.router.policies.base import PolicyBase, register_policy
from cluster.router.view import ClusterView, RequestContext, WorkerInfo
from config.base import Frozen


def common_prefix_len(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share at their start (slice comparisons run in C; a binary search over them
    costs O(n log n) character compares instead of a Python loop over n)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("children", "parent", "tenants", "text")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, float] = {}
        """Tenant -> last access time (ms on the caller's clock)."""


class ApproxTree:
    """sgl-router's multi-tenant character radix tree (``tree.rs``).

    Invariants: children are keyed by the first character of their text; ``sizes[t]`` is the number of
    characters of the nodes that hold tenant ``t`` (the root's empty text included, so a registered tenant
    with nothing routed has size 0); a tenant on a node is on every ancestor of it. Eviction removes a tenant
    from its least recently accessed leaves first (a leaf *for a tenant*: no child holds that tenant), then
    from parents that become leaves, until the tenant fits; a node left with no tenant and no child goes.
    """

    def __init__(self) -> None:
        self.root = _Node("", None)
        self.sizes: dict[str, int] = {}

    def add_tenant(self, tenant: str, now_ms: float) -> None:
        """sgl-router's ``insert("", url)`` when a worker joins."""
        self.insert("", tenant, now_ms)

    def _touch(self, node: _Node, tenant: str, now_ms: float) -> None:
        if tenant not in node.tenants:
            self.sizes[tenant] = self.sizes.get(tenant, 0) + len(node.text)
        node.tenants[tenant] = now_ms

    def insert(self, text: str, tenant: str, now_ms: float) -> None:
        node = self.root
        node.tenants[tenant] = now_ms
        self.sizes.setdefault(tenant, 0)
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node)
                node.children[text[i]] = leaf
                self._touch(leaf, tenant, now_ms)
                return
            k = common_prefix_len(child.text, text[i:i + len(child.text)])
            if k < len(child.text):
                child = self._split(child, k)
            self._touch(child, tenant, now_ms)
            node = child
            i += k

    @staticmethod
    def _split(node: _Node, k: int) -> _Node:
        """Cut ``node``'s text after ``k`` characters; the new upper node copies its tenants and times."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.text[:k], parent)
        upper.tenants = dict(node.tenants)
        parent.children[upper.text[0]] = upper
        node.text = node.text[k:]
        node.parent = upper
        upper.children[node.text[0]] = node
        return upper

    def prefix_match(self, text: str, now_ms: float) -> tuple[int, str | None]:
        """Characters matched, and a tenant of the node where the walk stopped (``None`` for a bare root),
        whose access time is refreshed from that node up to the root."""
        node = self.root
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            k = common_prefix_len(child.text, text[i:i + len(child.text)])
            i += k
            node = child
            if k < len(child.text):
                break
        if not node.tenants:
            return i, None
        tenant = min(node.tenants.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        up: _Node | None = node
        while up is not None:
            up.tenants[tenant] = now_ms
            up = up.parent
        return i, tenant

    def smallest_tenant(self) -> str | None:
        if not self.sizes:
            return None
        return min(self.sizes.items(), key=lambda kv: (kv[1], kv[0]))[0]

    @staticmethod
    def _leaf_tenants(node: _Node) -> list[str]:
        below = {t for c in node.children.values() for t in c.tenants}
        return [t for t in node.tenants if t not in below]

    def _detach(self, node: _Node, tenant: str) -> None:
        if node.tenants.pop(tenant, None) is not None:
            self.sizes[tenant] = max(0, self.sizes.get(tenant, 0) - len(node.text))
        if not node.children and not node.tenants and node.parent is not None and node.text:
            node.parent.children.pop(node.text[0], None)

    def evict(self, max_size: int) -> None:
        """``evict_tenant_by_size``: least recently used leaves first, per tenant, until each fits."""
        order = itertools.count()
        heap: list[tuple[float, int, str, _Node]] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for t in self._leaf_tenants(n):
                heapq.heappush(heap, (n.tenants[t], next(order), t, n))
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if self.sizes.get(tenant, 0) <= max_size:
                continue
            self._detach(node, tenant)
            parent = node.parent
            if parent is not None and tenant in self._leaf_tenants(parent):
                heapq.heappush(heap, (parent.tenants[tenant], next(order), tenant, parent))

    def remove_tenant(self, tenant: str) -> None:
        stack = [self.root]
        leaves: list[_Node] = []
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if tenant in self._leaf_tenants(n):
                leaves.append(n)
        while leaves:
            n = leaves.pop()
            self._detach(n, tenant)
            if n.parent is not None and tenant in self._leaf_tenants(n.parent):
                leaves.append(n.parent)
        self.sizes.pop(tenant, None)

    def used_sizes(self) -> dict[str, int]:
        """Sizes recomputed from the nodes (``sizes`` is maintained incrementally; tests compare them)."""
        out: dict[str, int] = {}
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for t in n.tenants:
                out[t] = out.get(t, 0) + len(n.text)
        return out


def routing_text(ctx: RequestContext) -> str:
    """The text sgl-router routes on (see the module docstring)."""
    body = ctx.body
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.append(" ".join(p["text"] for p in content
                                      if isinstance(p, dict) and isinstance(p.get("text"), str)))
        return " ".join(parts)
    prompt: Any = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return " ".join(prompt)
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return " ".join(map(str, prompt))
    return ctx.text or " ".join(map(str, ctx.prompt_ids))


@register_policy("sglang_cache_aware")
class SGLangCacheAware(PolicyBase):
    class Params(Frozen):
        """sgl-router 0.3.2's defaults."""

        cache_threshold: float = Field(default=0.3, ge=0, le=1)
        balance_abs_threshold: int = Field(default=64, ge=0)
        balance_rel_threshold: float = Field(default=1.5, ge=0)
        max_tree_size: int = Field(default=2**26, gt=0)
        eviction_interval_s: float = Field(default=60.0, ge=0)
        """0: never evict."""

    name = "sglang_cache_aware"
    reason = "cache_hit"
    needs_prefix = False
    """It reads the request's text itself; no tokenizing, no prefix index."""

    def __init__(self, rng: random.Random, params: SGLangCacheAware.Params) -> None:
        super().__init__(rng, params)
        self.cache_threshold = params.cache_threshold
        self.abs_threshold = params.balance_abs_threshold
        self.rel_threshold = params.balance_rel_threshold
        self.max_tree_size = params.max_tree_size
        self.eviction_interval_ms = params.eviction_interval_s * 1000.0
        self.tree = ApproxTree()
        self._now: Callable[[], float] = lambda: 0.0
        self._next_eviction_ms: float | None = None

    def _clock(self, view: ClusterView) -> float:
        self._now = lambda: view.now() * 1000.0
        now = self._now()
        if self.eviction_interval_ms > 0:
            if self._next_eviction_ms is None:
                self._next_eviction_ms = now + self.eviction_interval_ms
            elif now >= self._next_eviction_ms:
                self.tree.evict(self.max_tree_size)
                periods = (now - self._next_eviction_ms) // self.eviction_interval_ms + 1
                self._next_eviction_ms += periods * self.eviction_interval_ms
        return now

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        now = self._clock(view)
        for w in view.workers.values():
            if w.name not in self.tree.sizes:
                self.tree.add_tenant(w.name, now)
        for gone in [t for t in self.tree.sizes if t not in view.workers]:
            self.tree.remove_tenant(gone)
        loads = [w.inflight for w in view.workers.values()]
        hi, lo = max(loads), min(loads)
        by_load = sorted(candidates, key=lambda w: (w.inflight, w.name))
        text = routing_text(ctx)
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            self.reason = "imbalanced"
            return by_load
        matched, tenant = self.tree.prefix_match(text, now)
        rate = matched / len(text) if text else 0.0
        if rate <= self.cache_threshold:
            self.reason = "least_loaded"
            return by_load
        names: dict[str, WorkerInfo] = {w.name: w for w in candidates}
        first = names.get(tenant) if tenant is not None else None
        self.reason = "cache_hit"
        if first is None:
            self.reason = "fallback"
            first = candidates[0]
        return [first, *(w for w in by_load if w is not first)]

    def on_routed(self, worker: WorkerInfo, ctx: RequestContext) -> None:
        self.tree.insert(routing_text(ctx), worker.name, self._now())
