"""Choosing workers for a request: the eligible pool, the prompt's prefix, the policy's ranking.

- ``eligible``: healthy (feed alive), breaker closed, serving the model, of the allowed roles and, when the
  request names a residency region, *only* that region's (a hard filter: first try, retries, migration);
- ``prepare``: when the policy or the region strategy ``needs_prefix``, the prompt's token ids and KV block
  hashes, computed as the engines will (same tokenizer, same hashing), and each candidate's prefix overlap
  from the prefix index (the engines' KV events, plus what the router sent where and the events have not
  confirmed yet: ``InflightPrefixes``) or the approximate index (what the router sent where); a prompt
  that misses every cache (or extends one the prompt memo holds, past what any candidate holds) may be ranked
  from its head and token count, its tail tokenized once it is sent
  (``defer_tail``, ``complete``);
- ``rank``: the region strategy orders the pool, the policy choosing within it.

The chooser holds no request state but the contexts whose tail is pending (a ``prepare`` first completes those
whose prompt starts with its own first block, the only ones whose records it can use); it is deterministic given
its RNG and the view.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from actors.engine.kv_blocks import BlockHash, hash_request_blocks
from actors.engine.tokenizer import Tokenizer
from actors.openai_api import ApiError, ChatCompletionRequest, validate_request
from cluster.router.policies import POLICIES, RoutingPolicy, make_policy
from cluster.router.prefix_index import ApproximateIndex, InflightPrefixes, PrefixIndex
from cluster.router.prompt_memo import Encoded, MemoEntry, PromptMemo
from cluster.router.regions import PrefillEstimate, Topology, make_region_strategy
from cluster.router.tiers import TierPricing
from cluster.router.view import ClusterView, RequestContext, WorkerId, WorkerInfo
from config.cluster import RouterSpec

HEAD_BLOCKS = 2
"""Blocks of a prompt hashed, at most, before ranking it when the rest may wait (``Chooser.prepare``). The first
block alone decides a miss (overlaps count leading blocks: where no candidate holds the first block, none holds
any); only where one holds it is the second tokenized and hashed too (``Chooser._head_only``). A new prefix's
words are new to the router, and the second block's cost ~30 us hot (more cold) on a miss's path before its send."""
LEARN_SLICE = 256
"""Words of a deferred miss's tail tokenized per pass of the loop (``Chooser.complete_soon``): ~0.3-0.6 ms of CPU
when they are new to the tokenizer."""
HASH_SLICE = 48
"""Blocks of a deferred miss's tail hashed per pass of the loop (``Chooser.complete_soon``): ~0.1-0.2 ms of CPU."""
WHOLE_REQUEST_ROLES = ("colocated", "decode")
"""Roles that serve a whole request: colocated engines, and decode engines in a P/D cluster."""


@dataclass(frozen=True)
class RoutedRequest:
    """The few fields the router reads; the engine validates the whole request."""

    body: dict[str, Any]
    chat: bool
    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    ignore_eos: bool

    @staticmethod
    def of(body: dict[str, Any], chat: bool) -> RoutedRequest:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "invalid field 'model': Input should be a valid string", "model")
        opts = body.get("stream_options")
        limit = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens", 16)
        return RoutedRequest(body, chat, model, body.get("stream") is True,
                             isinstance(opts, dict) and opts.get("include_usage") is True,
                             limit if isinstance(limit, int) else None, body.get("ignore_eos") is True)


class Chooser:
    def __init__(self, spec: RouterSpec, view: ClusterView, topology: Topology, prefill_ms: PrefillEstimate,
                 rng: random.Random, tier_pricing: TierPricing | None = None, *, prompt_memo: bool = True) -> None:
        self.spec = spec
        self.view = view
        self.rng = rng
        self.inflight = InflightPrefixes(spec.inflight_ttl_s * 1000.0) if spec.inflight_prefixes else None
        self.index = PrefixIndex(inflight=self.inflight)
        self.approx = ApproximateIndex(spec.approx_ttl_s * 1000.0)
        self.strategy = make_region_strategy(spec.region_strategy, topology, prefill_ms)
        self.policy = make_policy(spec.policy, rng, spec.policy_params)
        self._policies: dict[str, RoutingPolicy] = {spec.policy: self.policy}
        self._tokenizers: dict[int, Tokenizer] = {}
        self._memos: dict[tuple[int, int], PromptMemo] = {}
        """Text prompts' ids and hashes by text prefix, per (vocabulary, block size) (``prompt_memo``)."""
        self.use_memo = prompt_memo
        """False: every text prompt is tokenized and hashed from its start (the memo's baseline)."""
        self._pending: list[RequestContext] = []
        """Contexts ranked from their prompt's head, not completed yet (``prepare``)."""
        self.tier_pricing = tier_pricing
        """Prices prefixes the events place in lower tiers (None: such hits count as misses)."""

    def policy_for(self, name: str | None) -> RoutingPolicy:
        """The configured policy, or the one a request names (``X-Route-Policy``) with default parameters."""
        if not name:
            return self.policy
        p = self._policies.get(name)
        if p is None:
            if name not in POLICIES:
                raise ApiError(400, f"unknown routing policy {name!r} in X-Route-Policy "
                                    f"(known: {', '.join(sorted(POLICIES))})")
            p = self._policies[name] = make_policy(name, self.rng)
        return p

    def eligible(self, model: str | None, residency: str | None, exclude: set[WorkerId] | None = None,
                 roles: tuple[str, ...] = WHOLE_REQUEST_ROLES) -> list[WorkerInfo]:
        skip = exclude or set()
        out = [w for w in self.view.workers.values()
               if w.role in roles and w.name not in skip and self.view.eligible(w)
               and (model is None or not w.model or w.model == model)
               and (residency is None or w.region == residency)]
        return sorted(out, key=lambda w: w.name)

    def needs_prefix(self, policy: RoutingPolicy) -> bool:
        return policy.needs_prefix or self.strategy.needs_prefix

    def _tokenizer(self, vocab: int) -> Tokenizer:
        tok = self._tokenizers.get(vocab)
        if tok is None:
            tok = self._tokenizers[vocab] = Tokenizer(vocab)
        return tok

    def memo(self, vocab: int, block_size: int) -> PromptMemo:
        m = self._memos.get((vocab, block_size))
        if m is None:
            m = self._memos[(vocab, block_size)] = PromptMemo(self._tokenizer(vocab), block_size)
        return m

    def fill_prompt(self, ctx: RequestContext, req: RoutedRequest, workers: list[WorkerInfo],
                    known: Encoded | None = None) -> None:
        """Token ids and block hashes as the engines will compute them. A prompt that is not one of the
        accepted shapes yields no ids here (the engine's 400 will reach the client). ``known``: a text prompt's
        ids and hashes, computed already (``complete_soon``)."""
        self.complete(ctx)
        if ctx.prompt_ids or not workers:
            return
        tok = self._tokenizer(workers[0].vocab_size)
        try:
            if req.chat:
                chat = validate_request(req.body, ChatCompletionRequest)
                pairs = [(m.role, m.text()) for m in chat.messages]
                ctx.prompt_ids = tok.chat_prompt(pairs)
                ctx.text = "".join(t for _, t in pairs)
            else:
                p = req.body.get("prompt")
                if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
                    p = p[0]
                if isinstance(p, str) and not self.use_memo:
                    ids, hashes = known if known is not None else (tok.encode(p), None)
                    ctx.prompt_ids, ctx.text = ids, p
                    if hashes is not None:
                        ctx.block_hashes = cast(list[int], hashes)
                        return
                elif isinstance(p, str):  # a hit repeats text met before: tokenized and hashed from where it parts
                    ids, hashes = self.memo(workers[0].vocab_size, workers[0].block_size).encode(p, known)
                    ctx.prompt_ids, ctx.text, ctx.block_hashes = ids, p, cast(list[int], hashes)  # BlockHash is an int
                    return
                elif isinstance(p, list) and all(isinstance(x, int) for x in p):
                    ctx.prompt_ids = p
        except ApiError:
            return
        ctx.block_hashes = cast(list[int], hash_request_blocks(ctx.prompt_ids, workers[0].block_size))

    def overlap(self, ctx: RequestContext, workers: list[WorkerInfo]) -> dict[WorkerId, int]:
        return self._overlap_of(ctx.block_hashes, workers)

    def _overlap_of(self, hashes: list[int], workers: list[WorkerInfo]) -> dict[WorkerId, int]:
        names = [w.name for w in workers]
        if self.spec.index_mode == "events":
            return self.index.overlap(hashes, names, self.view.now() * 1000.0)
        return self.approx.overlap(hashes, names, self.view.now() * 1000.0)

    def prepare(self, policy: RoutingPolicy, ctx: RequestContext, req: RoutedRequest,
                pool: list[WorkerInfo], *, defer_tail: bool = False) -> None:
        """The prompt's ids, hashes and overlaps when the policy or the region strategy needs them.

        ``defer_tail`` (the caller will ``complete`` the context once its request is sent): a text prompt
        whose first ``HEAD_BLOCKS`` blocks no candidate holds, for a policy that ``ranks_on_counts``, is
        ranked from those blocks' overlaps and the prompt's token count alone; the rest of it is tokenized
        and hashed, and the attempt's in-flight record made, by ``complete``. A cache miss is the first
        request of a new prefix, whose words the router has mostly never met: tokenizing them all was ~1-2 ms
        of its CPU before the send (``bench/router_miss``). A prompt that extends one the prompt memo holds is
        ranked the same way from the memo's blocks and the next one when no candidate holds that next block
        (``_known_head``: a prefix-cache hit with a new ending). Every ``prepare`` first completes the contexts
        still pending whose prompt starts with the same block (``_flush_sharing``), so each decision sees every
        earlier request's in-flight record that can count in it, as without deferral: a record counts *leading*
        blocks, and block hashes chain from the first, so a prompt that starts with another block can overlap
        none of another's. A request for another prefix then no longer waits for a miss's tail it cannot use.
        A policy that needs no prefix reads no index, and waits for none."""
        if not self.needs_prefix(policy):
            return
        if defer_tail and self._head_only(policy, ctx, req, pool):
            return
        self.fill_prompt(ctx, req, pool)
        self._flush_sharing(ctx.block_hashes)
        ctx.overlap = self.overlap(ctx, pool)
        self.price_tiers(ctx, pool)

    def _head_only(self, policy: RoutingPolicy, ctx: RequestContext, req: RoutedRequest,
                   pool: list[WorkerInfo]) -> bool:
        """Rank from the prompt's head when that is a miss on every candidate (see ``prepare``)."""
        if not policy.ranks_on_counts or self.strategy.needs_prefix or req.chat or not pool \
                or (self.tier_pricing is not None and self.index.tiers):
            return False
        p = req.body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if not isinstance(p, str):
            return False
        bs = pool[0].block_size
        if self.use_memo:
            chars, tokens, entry = self.memo(pool[0].vocab_size, bs).match(p)
            if entry is not None and tokens >= HEAD_BLOCKS * bs:  # a prefix met before, likely a hit
                return self._known_head(ctx, req, pool, p, chars, tokens, entry)
        tok = self._tokenizer(pool[0].vocab_size)
        for blocks in (1, HEAD_BLOCKS):  # the first block; both when a candidate holds the first
            got = tok.head_and_count(p, blocks * bs)  # (split_head's head, and the count, in one pass)
            if got is None:
                return False
            head, count = got
            hashes = [int(h) for h in hash_request_blocks(head, bs, limit=blocks)]
            if len(hashes) < blocks:
                return False  # a short prompt: nothing to save
            if self._defer(ctx, req, pool, p, hashes, count, fresh=tok):
                return True
        return False

    def _known_head(self, ctx: RequestContext, req: RoutedRequest, pool: list[WorkerInfo], p: str, chars: int,
                    tokens: int, entry: MemoEntry) -> bool:
        """Rank a prompt that extends one the memo holds (its first ``tokens`` ids and their ``k`` full blocks'
        hashes known, up to character ``chars``) from those blocks and one more, when no candidate holds that
        one: the overlap is then final (it counts *leading* blocks), so the policy needs only the prompt's
        count, and the rest (tokenizing the new part, hashing its blocks) waits for the send, as a miss's tail
        does. The next block's ids are the entry's last partial block and the first words of the new part
        (``head_and_count``, which also counts the rest). A candidate that holds that block, or a prompt with no
        full block past the memo's, walks the whole prompt first, as before. The common hit of a prefix-heavy
        workload (a 2048-token prefix the memo knows and 128 new tokens) then tokenizes one block's words before
        its send instead of all 128 (mostly words the tokenizer has to learn)."""
        bs = pool[0].block_size
        k = tokens // bs
        need = (k + 1) * bs - tokens  # tokens of block k still to come from the new part: 1 .. bs
        got = self._tokenizer(pool[0].vocab_size).head_and_count(p[chars:], need) if chars < len(p) else None
        if got is None:
            return False
        head, rest = got
        count = tokens + rest
        if count < (k + 1) * bs:
            return False  # no full block past the memo's: nothing to defer
        known = entry.ids[:tokens] + head[:need]
        hashes = cast(list[int], hash_request_blocks(known, bs, start=entry.hashes[:k]))  # (BlockHash is an int)
        return self._defer(ctx, req, pool, p, hashes, count)

    def _defer(self, ctx: RequestContext, req: RoutedRequest, pool: list[WorkerInfo], p: str, hashes: list[int],
               count: int, fresh: Tokenizer | None = None) -> bool:
        """Rank from the leading ``hashes`` and the prompt's token ``count`` when no candidate holds all of them
        (each worker's overlap is then final); the rest is left to ``complete`` (``fresh``: the tokenizer, when
        the prompt's words are likely new to it, a miss's: ``complete_soon`` tokenizes it in slices)."""
        self._flush_sharing(hashes)
        overlap = self._overlap_of(hashes, pool)
        if max(overlap.values(), default=0) >= len(hashes):
            return False  # some worker may hold more: walk the whole prompt
        bs = pool[0].block_size
        ctx.overlap, ctx.text = overlap, p
        ctx.counted_tokens, ctx.counted_blocks = count, count // bs
        ctx.tail = _Tail(self, ctx, req, pool, hashes[0], fresh)
        self._pending.append(ctx)
        return True

    def _finish_tail(self, ctx: RequestContext, req: RoutedRequest, pool: list[WorkerInfo],
                     known: Encoded | None = None) -> None:
        ctx.tail = None
        self.fill_prompt(ctx, req, pool, known)  # as many blocks as counted (Tokenizer.head_and_count, tested)
        ctx.counted_tokens = ctx.counted_blocks = None
        if ctx.routed_to is not None:
            self._record(ctx.routed_to, ctx)

    def complete(self, ctx: RequestContext) -> None:
        """Tokenize what ``prepare`` deferred and make the in-flight record (nothing when nothing is pending)."""
        if ctx.tail is not None:
            self._pending = [c for c in self._pending if c is not ctx]
            ctx.tail()

    async def complete_soon(self, ctx: RequestContext, after: Awaitable[object] | None = None) -> None:
        """``complete``, for a deferred miss a slice at a time with the loop let go between slices: its words
        ``LEARN_SLICE`` at a time (``Tokenizer.encode_pieces``), its blocks ``HASH_SLICE`` at a time. A new
        prefix's words are mostly new to the router's tokenizer: its tail held the loop for ~3-5 ms after the send,
        delaying every other request's relay and ranking meanwhile. What ``complete`` then records is the same
        (``fill_prompt`` takes the ids and hashes as they would have been computed). A ``prepare`` between two
        slices that needs this context completes it itself (``_flush_sharing``), and the slices stop. ``after``:
        awaited before the first slice (``tail_meanwhile``)."""
        tail = ctx.tail
        if not isinstance(tail, _Tail) or tail.fresh is None:
            self.complete(ctx)
            return
        if after is not None:
            await after
            if ctx.tail is not tail:
                return  # completed meanwhile
        ids: list[int] = []
        for piece in tail.fresh.encode_pieces(ctx.text, LEARN_SLICE):
            ids += piece
            await asyncio.sleep(0)
            if ctx.tail is not tail:
                return  # completed meanwhile
        bs = tail.pool[0].block_size
        hashes: list[BlockHash] = []
        while len(hashes) < len(ids) // bs:
            hashes = hash_request_blocks(ids, bs, start=hashes, limit=len(hashes) + HASH_SLICE)
            await asyncio.sleep(0)
            if ctx.tail is not tail:
                return
        tail.known = (ids, hashes)
        self.complete(ctx)

    def tail_meanwhile(self, ctx: RequestContext,
                       after: Callable[[], Awaitable[object]] | None = None) -> asyncio.Task[None] | None:
        """Once ``ctx``'s request is sent: a miss's tail (``complete_soon``, in slices) as a task of its own, so the
        caller relays the engine's answer meanwhile; any other tail completed at once (None). Before, the relay
        began only once the tail was done: ~3-7 ms of the router's CPU for a new prefix's 2176 words, stretched
        by a busy host's other work, which the first chunk waited for whenever it came back sooner (a short
        prefill, or a tail slowed down). The records are the same: a ``prepare`` that can use them completes the
        tail first (``_flush_sharing``), and ``end_tail`` completes what is left before the attempt ends.

        ``after`` (called only when there is a task to make): what the slices wait for first, the worker's
        prefill of the prompt (its first token). The engine meets the same new words meanwhile (reading,
        tokenizing and hashing the prompt, then its prefill's steps); where the two share a host's cores the
        router's tail (~5-10 ms of CPU for a new 2176-word prefix) delays the engine's work and so the miss's
        own first token, which nothing gains: the only decisions that use the tail's records are those of
        requests that share the prompt's first block, and they complete it themselves first. ``bench/router_miss
        --engine-ms 45 --cold --engine-tokenizes`` (engines that tokenize each new prompt on receipt; 2 cores):
        the TTFT kvmesh adds over the direct path, 3.5-4.7 ms with the tail begun at the send, 1.1-1.7 ms after
        the first token (sgl-router's: 0.9-1.4)."""
        tail = ctx.tail
        if not isinstance(tail, _Tail) or tail.fresh is None:
            self.complete(ctx)
            return None
        return asyncio.get_running_loop().create_task(self.complete_soon(ctx, after() if after is not None else None))

    def end_tail(self, task: asyncio.Task[None] | None, ctx: RequestContext) -> None:
        """The attempt ends (answered, failed or cancelled): ``tail_meanwhile``'s task stops and what it had left is
        completed here, so a failed attempt's in-flight record exists when ``failed`` drops it."""
        if task is not None:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # (retrieved: an error in the tail raises again from ``complete`` below)
        self.complete(ctx)

    def _flush_sharing(self, hashes: list[int]) -> None:
        """Complete the pending contexts whose prompt starts with block ``hashes[0]`` (all of them for a prompt
        with no full block): the only ones whose in-flight records can count in its overlap (``prepare``)."""
        if not self._pending:
            return
        if not hashes:
            self.flush()
            return
        first = hashes[0]
        for c in [c for c in self._pending if cast(_Tail, c.tail).first == first]:
            self.complete(c)

    def flush(self) -> None:
        """Complete every context still pending."""
        while self._pending:
            self.complete(self._pending[0])

    def price_tiers(self, ctx: RequestContext, pool: list[WorkerInfo]) -> None:
        """Each worker's lower-tier hits past its GPU overlap, and their load cost in prefill blocks."""
        tiers = self.index.tiers
        if self.tier_pricing is None or not tiers or not ctx.block_hashes:
            return
        by_region: dict[str, list[WorkerId]] = {}
        for w in self.view.workers.values():
            by_region.setdefault(w.region, []).append(w.name)
        for w in pool:
            gpu = ctx.overlap.get(w.name, 0)
            counts = tiers.extend(ctx.block_hashes, gpu, w.name, by_region.get(w.region, ()))
            hits, cost = self.tier_pricing.equivalent_blocks(w, gpu, counts)
            if hits:
                ctx.tier_hits[w.name] = hits
                ctx.tier_load_blocks[w.name] = cost

    def rank(self, policy: RoutingPolicy, pool: list[WorkerInfo], ctx: RequestContext) -> list[WorkerInfo]:
        return self.strategy.rank(policy, pool, ctx, self.view)

    def routed(self, policy: RoutingPolicy, worker: WorkerInfo, ctx: RequestContext) -> None:
        """The request goes to ``worker``: the policy's state, and the in-flight or approximate index, learn it
        (the index once the prompt is all hashed: ``complete``)."""
        policy.on_routed(worker, ctx)
        ctx.routed_to = worker.name
        if ctx.tail is None:
            self._record(worker.name, ctx)

    def _record(self, worker: WorkerId, ctx: RequestContext) -> None:
        if not ctx.block_hashes:
            return
        if self.spec.index_mode == "approximate":
            self.approx.record(worker, ctx.block_hashes, self.view.now() * 1000.0)
        elif self.inflight is not None:
            # Only the blocks the events do not show there yet: the others need no provisional entry (and one
            # would outlive their eviction until its TTL, as no new ``stored`` event confirms a block reused).
            self.inflight.drop(ctx.inflight_ticket)
            held = self.index.held_depth(worker, ctx.block_hashes)
            ctx.inflight_ticket = self.inflight.record(worker, ctx.block_hashes[held:], self.view.now() * 1000.0) \
                if held < len(ctx.block_hashes) else None

    def failed(self, ctx: RequestContext) -> None:
        """The attempt ``routed`` recorded failed before its worker prefilled anything: forget it."""
        ctx.routed_to = None
        if self.inflight is not None:
            self.inflight.drop(ctx.inflight_ticket)
            ctx.inflight_ticket = None

    def drop_worker(self, name: WorkerId) -> None:
        self.index.drop_worker(name)
        self.approx.drop_worker(name)


@dataclass(eq=False)
class _Tail:
    """A deferred context's ``tail``: ``Chooser._finish_tail``; the hash of the prompt's first block; the tokenizer
    that meets the prompt's words for the first time when they are likely new (a miss; None for a prefix the memo
    knows); the ids and hashes ``complete_soon`` computed."""

    chooser: Chooser
    ctx: RequestContext
    req: RoutedRequest
    pool: list[WorkerInfo]
    first: int
    fresh: Tokenizer | None
    known: Encoded | None = None

    def __call__(self) -> None:
        self.chooser._finish_tail(self.ctx, self.req, self.pool, self.known)
