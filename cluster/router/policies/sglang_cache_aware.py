"""SGLang router's ``cache_aware`` policy, re-implemented faithfully as a baseline.

The SGLang router (sgl-router, ``policies/cache_aware.rs``) keeps an *approximate* radix tree of the
request texts it routed, one tenant per worker, and no knowledge of what the engines really cache:

1. If the load (requests the router has open per worker) is imbalanced, that is
   ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold x min``, route to the least
   loaded worker (and still insert the text under it).
2. Otherwise find the deepest prefix match in the tree; if ``matched / len(text) > cache_threshold``
   route to that tenant, else to the tenant with the smallest tree (most spare cache).
3. Insert the text under the chosen tenant. Every ``eviction_interval`` routed requests (the Rust
   router uses a timer) each tenant is trimmed to ``max_tree_size`` elements, least recently used first.

Defaults are sgl-router's: cache_threshold 0.5, balance_abs_threshold 32, balance_rel_threshold 1.0001,
max_tree_size 100000 (it matches characters; kvmesh matches token ids when the prompt is given as ids).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Hashable, Sequence

from pydantic import Field

from cluster.router.policies.base import PolicyBase, by_load, register_policy
from cluster.router.view import ClusterView, RequestContext, WorkerInfo
from config.base import Frozen


class _Node:
    __slots__ = ("children", "label", "parent", "tenants")

    def __init__(self, label: tuple[Hashable, ...], parent: _Node | None) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[Hashable, _Node] = {}
        self.tenants: dict[str, int] = {}  # tenant -> last access tick


class ApproxTree:
    """Multi-tenant radix tree over sequences (characters or token ids) with per-tenant LRU trimming."""

    def __init__(self) -> None:
        self.root = _Node((), None)
        self._tick = itertools.count(1)
        self.sizes: dict[str, int] = {}

    def add_tenant(self, tenant: str) -> None:
        self.root.tenants.setdefault(tenant, 0)
        self.sizes.setdefault(tenant, 0)

    def insert(self, seq: Sequence[Hashable], tenant: str) -> None:
        now = next(self._tick)
        node = self.root
        node.tenants[tenant] = now
        self.sizes.setdefault(tenant, 0)
        i = 0
        seq = tuple(seq)
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                leaf = _Node(seq[i:], node)
                node.children[seq[i]] = leaf
                leaf.tenants[tenant] = now
                self.sizes[tenant] += len(leaf.label)
                return
            lab = child.label
            k = 0
            while k < len(lab) and i + k < len(seq) and lab[k] == seq[i + k]:
                k += 1
            if k < len(lab):
                child = self._split(child, k)
            if tenant not in child.tenants:
                self.sizes[tenant] += len(child.label)
            child.tenants[tenant] = now
            node = child
            i += k

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node``'s label after ``k`` elements; return the new upper node."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.label[:k], parent)
        upper.tenants = dict(node.tenants)
        parent.children[node.label[0]] = upper
        node.label = node.label[k:]
        node.parent = upper
        upper.children[node.label[0]] = node
        return upper

    def prefix_match(self, seq: Sequence[Hashable]) -> tuple[int, str | None]:
        """Length of the deepest match and the most recently used tenant holding all of it."""
        node = self.root
        i = 0
        best: tuple[int, _Node] = (0, node)
        seq = tuple(seq)
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                break
            lab = child.label
            k = 0
            while k < len(lab) and i + k < len(seq) and lab[k] == seq[i + k]:
                k += 1
            i += k
            best = (i, child)
            if k < len(lab):
                break
            node = child
        matched, at = best
        if not at.tenants:
            return 0, None
        tenant = max(at.tenants.items(), key=lambda kv: (kv[1], kv[0]))[0]
        return matched, tenant

    def smallest_tenant(self, among: Sequence[str]) -> str:
        return min(among, key=lambda t: (self.sizes.get(t, 0), t))

    def remove_tenant(self, tenant: str) -> None:
        stack = [self.root]
        while stack:
            n = stack.pop()
            n.tenants.pop(tenant, None)
            stack.extend(n.children.values())
        self.sizes.pop(tenant, None)
        self._prune(self.root)

    def _prune(self, node: _Node) -> None:
        for key, child in list(node.children.items()):
            self._prune(child)
            if not child.tenants and not child.children:
                del node.children[key]

    def evict(self, max_size: int) -> None:
        """Trim each tenant to ``max_size`` elements by dropping its least recently used leaves."""
        for tenant, size in list(self.sizes.items()):
            if size <= max_size:
                continue
            leaves: list[_Node] = []
            stack = [self.root]
            while stack:
                n = stack.pop()
                owned_children = [c for c in n.children.values() if tenant in c.tenants]
                if n is not self.root and tenant in n.tenants and not owned_children:
                    leaves.append(n)
                stack.extend(owned_children)
            leaves.sort(key=lambda n: n.tenants[tenant])
            for leaf in leaves:
                if self.sizes[tenant] <= max_size:
                    break
                node: _Node | None = leaf
                while node is not None and node is not self.root and tenant in node.tenants and not any(
                        tenant in c.tenants for c in node.children.values()):
                    del node.tenants[tenant]
                    self.sizes[tenant] -= len(node.label)
                    node = node.parent
            self._prune(self.root)


@register_policy("sglang_cache_aware")
class SGLangCacheAware(PolicyBase):
    class Params(Frozen):
        """sgl-router's defaults."""

        cache_threshold: float = Field(default=0.5, ge=0, le=1)
        balance_abs_threshold: int = Field(default=32, ge=0)
        balance_rel_threshold: float = Field(default=1.0001, ge=0)
        max_tree_size: int = Field(default=100_000, gt=0)
        eviction_interval_requests: int = Field(default=256, gt=0)

    name = "sglang_cache_aware"
    reason = "cache_hit"
    needs_prefix = True
    """It matches the prompt's text (or its ids), which the router fills in with the prefix."""

    def __init__(self, rng: random.Random, params: SGLangCacheAware.Params) -> None:
        super().__init__(rng, params)
        self.cache_threshold = params.cache_threshold
        self.abs_threshold = params.balance_abs_threshold
        self.rel_threshold = params.balance_rel_threshold
        self.max_tree_size = params.max_tree_size
        self.eviction_every = params.eviction_interval_requests
        self.tree = ApproxTree()
        self._routed = 0

    @staticmethod
    def _seq(ctx: RequestContext) -> Sequence[Hashable]:
        return ctx.text if ctx.text else ctx.prompt_ids

    def rank(self, candidates: list[WorkerInfo], ctx: RequestContext, view: ClusterView) -> list[WorkerInfo]:
        for w in candidates:
            self.tree.add_tenant(w.name)
        loads = [w.inflight for w in view.workers.values()]
        hi, lo = max(loads), min(loads)
        ordered_by_load = sorted(candidates, key=lambda w: (w.inflight, w.name))
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            self.reason = "imbalanced"
            return ordered_by_load
        seq = self._seq(ctx)
        matched, tenant = self.tree.prefix_match(seq)
        rate = matched / len(seq) if seq else 0.0
        names = {w.name: w for w in candidates}
        if tenant in names and rate > self.cache_threshold:
            self.reason = "cache_hit"
            first = names[tenant]  # type: ignore[index]
        else:
            self.reason = "smallest_tree"
            first = names[self.tree.smallest_tenant(list(names))]  # type: ignore[index]
        return [first, *(w for w in by_load(candidates) if w is not first)]

    def on_routed(self, worker: WorkerInfo, ctx: RequestContext) -> None:
        self.tree.insert(self._seq(ctx), worker.name)
        self._routed += 1
        if self._routed % self.eviction_every == 0:
            self.tree.evict(self.max_tree_size)
