"""``KVCacheManager``: a request's KV pages from admission to release, over the page pool,
``req_to_token`` and the radix prefix cache.

The scheduler asks it four things: how many tokens it may still allocate
(``available_tokens``: free pages plus evictable tree pages), to give a new request its
cached prefix (``match``), to grow a request by n tokens (``grow``, evicting LRU tree leaves
when the free list is short), and to let a request go (``release``: its computed tokens go
into the tree, its other pages back to the pool). ``cache_unfinished`` inserts what a
chunked prefill has computed so far, so a request with the same prefix admitted while the
chunks run can hit it.

Ownership of ``req.pages`` (in position order): the first ``req.cached_pages`` belong to the
tree and are locked through ``req.last_node``; the rest belong to the request. The tree is
keyed by ``req.lora_id`` (the request's LoRA adapter, None for the base model): a prefix is
only shared between requests of the same adapter. ``check`` proves that free +
request-owned + tree pages equal the pool, with no page counted twice.
"""

from __future__ import annotations

from engine.kv.pool import KVPool, ReqToTokenPool
from engine.kv.radix_cache import RadixCache


def _ns(req):
    """The radix tree namespace of ``req``: its LoRA adapter id (None: the base model)."""
    return getattr(req, "lora_id", None)


class KVCacheManager:
    """Args: pool, req_pool: the two KV levels; disable_cache: no prefix reuse."""

    def __init__(self, pool: KVPool, req_pool: ReqToTokenPool, disable_cache: bool = False):
        self.pool = pool
        self.req_pool = req_pool
        self.page_size = pool.page_size
        self.tree = RadixCache(pool, disable=disable_cache)

    @property
    def enabled(self) -> bool:
        return not self.tree.disable

    def available_tokens(self) -> int:
        """Tokens that can still be allocated: free pages plus evictable tree pages."""
        return self.pool.free_tokens() + self.tree.evictable_tokens()

    def used_tokens(self) -> int:
        """Tokens in use by requests (their own pages and the tree pages they lock)."""
        return self.pool.capacity_tokens - self.available_tokens()

    # ---- admission ----------------------------------------------------------------------
    def prefix_len(self, req) -> int:
        """Tokens of ``req`` that the tree holds now (no lock taken; for queue ordering)."""
        if not self.enabled or req.prompt_logprobs is not None:
            return 0
        pages, _ = self.tree.match_prefix(req.tokens(0, req.seq_len - 1), _ns(req))
        return len(pages) * self.page_size

    def match(self, req) -> int:
        """Give a request that holds no KV its longest cached prefix, locked; returns the
        prefix length in tokens. At least the last token is left to compute (its logits are
        sampled). Requests that want prompt logprobs match nothing: the prefix's logits would
        be missing."""
        assert not req.pages and req.kv_len == 0
        if not self.enabled or req.prompt_logprobs is not None:
            return 0
        pages, node = self.tree.match_prefix(req.tokens(0, req.seq_len - 1), _ns(req))
        if not pages:
            return 0
        self.tree.lock(node)
        req.pages = list(pages)
        req.cached_pages = len(pages)
        req.last_node = node
        req.kv_len = len(pages) * self.page_size
        return req.kv_len

    def unmatch(self, req) -> None:
        """Undo ``match`` for a request that was not admitted after all."""
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        req.pages, req.cached_pages, req.last_node, req.kv_len = [], 0, None, 0

    def write_prefix(self, req) -> None:
        """Point ``req_to_token`` at the cached prefix of a newly admitted request."""
        if req.kv_len:
            self.req_pool.write(req.req_pool_idx, 0,
                                self.pool.slots_for(req.pages, 0, req.kv_len))

    # ---- growth -------------------------------------------------------------------------
    def make_room(self, pages: int) -> None:
        """Evict tree leaves until ``pages`` pages are free (or nothing more is evictable):
        one tree walk for a whole step's allocations instead of one per request."""
        short = pages - self.pool.num_free_pages
        if short > 0:
            self.tree.evict(short)

    def grow(self, req, n: int) -> list[int] | None:
        """Slots for ``n`` more tokens of ``req`` (evicting tree leaves if needed); None,
        with nothing taken, when even eviction cannot make room."""
        short = self.pool.pages_needed(req.kv_len, len(req.pages), n) - self.pool.num_free_pages
        if short > 0:
            self.tree.evict(short)
        return self.pool.grow(req.pages, req.kv_len, n)

    def shrink(self, req, new_len: int) -> None:
        """Keep the KV of ``req``'s first ``new_len`` positions only (speculative decoding:
        the slots of rejected draft tokens): the whole pages past them go back to the pool;
        slots past ``new_len`` in the last kept page are rewritten by the next growth."""
        keep = -(-new_len // self.page_size)
        assert req.cached_pages <= keep <= len(req.pages), "shrink below the cached prefix"
        self.pool.free_pages(req.pages[keep:])
        del req.pages[keep:]
        req.kv_len = new_len

    # ---- release ------------------------------------------------------------------------
    def _real_len(self, req) -> int:
        """Leading tokens of ``req`` whose KV is (or is being) computed from real ids: a
        trailing placeholder id (overlap scheduling) has no known token to key it by."""
        n = len(req.origin_input_ids)
        for t in req.output_ids:
            if t < 0:
                break
            n += 1
        return min(req.kv_len, n)

    def cache_unfinished(self, req) -> None:
        """Insert the whole pages a chunked prefill has computed; the request keeps reading
        them, now from the tree (locked), so its ``req_to_token`` row may change where the
        tree already held a twin's copy of the same tokens."""
        if not self.enabled:
            return
        ps = self.page_size
        m = self._real_len(req) // ps
        if m <= req.cached_pages:
            return
        ids = req.tokens(0, m * ps)
        n_old, node = self.tree.insert(ids, req.pages[:m], _ns(req))
        if n_old > req.cached_pages:
            # pages [cached, n_old) duplicate the tree's: switch to the tree's copies
            tree_pages, _ = self.tree.match_prefix(ids, _ns(req))
            lo, hi = req.cached_pages, n_old
            dup = req.pages[lo:hi]
            req.pages[lo:hi] = tree_pages[lo:hi]
            self.pool.free_pages(dup)
            self.req_pool.write(req.req_pool_idx, lo * ps,
                                self.pool.slots_for(req.pages, lo * ps, hi * ps))
        self.tree.lock(node)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        req.last_node = node
        req.cached_pages = m

    def release(self, req, cache: bool = True) -> None:
        """Free a finished, aborted or preempted request's KV. With ``cache`` its computed
        whole pages go into the tree (the next turn of a conversation, or the request itself
        after a preemption, hits them); pass False when the KV may be wrong (a failed step)."""
        if req.pages:
            ps = self.page_size
            keep = req.cached_pages  # pages [0, keep) are the tree's
            if cache and self.enabled:
                m = self._real_len(req) // ps
                if m > keep:
                    n_old, _ = self.tree.insert(req.tokens(0, m * ps), req.pages[:m],
                                                _ns(req))
                    self.pool.free_pages(req.pages[keep:n_old])  # duplicates of tree pages
                    keep = m
            self.pool.free_pages(req.pages[keep:])
            req.pages = []
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
            req.last_node = None
        req.cached_pages = 0
        if req.req_pool_idx is not None:
            self.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        req.kv_len = 0

    def flush(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests hold tree pages."""
        return self.tree.flush()

    # ---- accounting ---------------------------------------------------------------------
    def check(self, reqs) -> None:
        """Assert the page invariant over ``reqs`` (every request that may hold pages).

        Raises:
            AssertionError: a page counted twice or lost, or the lock counts disagree.
        """
        free = self.pool.free_page_list()
        tree = self.tree.tree_pages()
        owned = [p for r in reqs for p in r.pages[r.cached_pages:]]
        every = free + tree + owned
        assert len(set(every)) == len(every), "KV page counted twice"
        assert len(every) == self.pool.num_pages, (
            f"KV pages lost: free {len(free)} + tree {len(tree)} + requests {len(owned)} "
            f"!= pool {self.pool.num_pages}")
        assert len(tree) == self.tree.total_pages, "radix cache size counters drifted"
        locked = sum(len(n.pages) for n in self.tree._nodes() if n.lock_ref > 0)
        assert locked == self.tree.protected_pages, "radix cache lock counters drifted"
        for r in reqs:
            if r.cached_pages:
                assert r.last_node is not None
