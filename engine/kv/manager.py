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

Windowed layers (``engine/kv/windowed.py``, a model whose sliding-window layers keep their
K/V in a pool of their own): ``req.swa_pages`` runs parallel to ``req.pages`` (0: freed).
Its held entries before ``req.swa_lo`` are the tree's (what ``match`` gave it), those from
``swa_lo`` on its own; ``grow`` frees its own once they lie wholly behind its window (and
moves ``swa_lo`` past them) and gives new full pages their windowed twins. The tree takes a
request's windowed pages only at ``release`` (by then only its last window is held), not
while a chunked prefill runs, so a long prompt never pins its windowed pages in the tree.
``match`` cuts a cached prefix back to where the tree still holds the windowed keys the
next token reads; ``check`` proves the windowed pool's count the same way.

Linear-attention layers (a model with ``RECURRENT_STATE`` layers, ``engine/kv/state_pool.py``):
``req.state_slot`` is the request's slot of conv and recurrent states, taken (zeroed) with its
``req_to_token`` row at admission (``take_state``) and given back by ``release`` (finish,
abort, preemption); ``check`` proves free + held slots equal the pool.

Prefix reuse for those models (``engine/kv/state_snapshots.py``): a cached prefix is only
reusable where the tree also holds a snapshot of the linear layers' states after exactly that
prefix, so ``match`` ends at the deepest node with one and ``take_state`` copies it into the
request's new slot. Snapshots are taken at page boundaries: after each prefill chunk whose end
is one (``snapshot_rows``, which the scheduler calls as it launches the step: the model runner
copies right after launching the forward) and at ``release`` (where ``kv_len`` is one and
every fed token is real). They wait on the request (``req.state_snaps``: ``(boundary, snapshot)``, in boundary order) until its pages
up to the boundary are in the tree (``cache_unfinished``, ``release``), then move to the node
that ends there (a node that has one already keeps it; the copy is freed). ``chunk_len`` picks
where a prefill chunk ends so that such boundaries exist: at a page boundary, at the
branching point where the KV matched further than a snapshot (``req.snap_branch``: the next
request with that prefix hits it), and, with pages of several tokens, at the prompt's last page
boundary (its end is rarely one).
"""

from __future__ import annotations

from engine.kv.pool import KVPool, ReqToTokenPool
from engine.kv.radix_cache import RadixCache
from engine.kv.state_pool import RecurrentStatePool
from engine.kv.state_snapshots import StateSnapshotPool
from engine.kv.windowed import WindowedKVPool, usable_prefix_pages

#: a prefill stops at the branching point of its match (to leave a snapshot there) when the
#: KV matched at least this many tokens beyond the snapshot its match was cut back to
BRANCH_SNAPSHOT_MIN = 32


def _ns(req):
    """The radix tree namespace of ``req``: its LoRA adapter id (None: the base model)."""
    return getattr(req, "lora_id", None)


class KVCacheManager:
    """Args: pool, req_pool: the two KV levels; disable_cache: no prefix reuse; swa_pool,
    swa_req_pool: the windowed layers' pool and ``req_to_token`` table, or None;
    state_pool: the linear-attention layers' recurrent-state slots, or None; snapshots:
    their snapshot pool (prefix reuse for such a model), or None: with a state pool and no
    snapshots the prefix cache is off."""

    def __init__(self, pool: KVPool, req_pool: ReqToTokenPool, disable_cache: bool = False,
                 swa_pool: WindowedKVPool | None = None,
                 swa_req_pool: ReqToTokenPool | None = None,
                 state_pool: RecurrentStatePool | None = None,
                 snapshots: StateSnapshotPool | None = None):
        self.pool = pool
        self.state_pool = state_pool
        self.req_pool = req_pool
        self.page_size = pool.page_size
        self.swa_pool = swa_pool
        self.swa_req_pool = swa_req_pool
        if state_pool is None or disable_cache:
            snapshots = None
        disable_cache = disable_cache or (state_pool is not None and snapshots is None)
        self.snapshots = snapshots
        self.tree = RadixCache(pool, disable=disable_cache, swa_pool=swa_pool,
                               snapshots=snapshots)

    @property
    def enabled(self) -> bool:
        return not self.tree.disable

    def available_tokens(self) -> int:
        """Tokens that can still be allocated: free pages plus evictable tree pages."""
        return self.pool.free_tokens() + self.tree.evictable_tokens()

    def swa_available_tokens(self) -> int:
        """Windowed slots that can still be allocated (free plus evictable tree pages); a
        large number without a windowed pool."""
        if self.swa_pool is None:
            return 1 << 62
        return self.swa_pool.free_tokens() + self.tree.evictable_swa * self.page_size

    def room(self, req, reserve: int = 0, swa_reserve: int = 0) -> int:
        """Tokens ``req`` may grow by now: the free slots of its last page plus what both
        pools can still allocate beyond ``reserve`` full-attention tokens and
        ``swa_reserve`` windowed slots kept for the running requests' next tokens (its own
        windowed pages behind the window count as free)."""
        tail = len(req.pages) * self.page_size - req.kv_len
        full = tail + self.available_tokens() - reserve
        if self.swa_pool is None:
            return full
        own = self._own_behind(req) * self.page_size
        return min(full, tail + self.swa_available_tokens() + own - swa_reserve)

    def swa_decode_reserve(self, reqs) -> int:
        """Windowed slots (whole pages) the next token of each of ``reqs`` (the running
        requests) takes: a page where its last page is full, unless ``grow`` gives one of its
        own pages back first (one that falls behind its window at that growth: a request
        past its window holds about W + one page however long it runs). 0 without a
        windowed pool."""
        if self.swa_pool is None:
            return 0
        pages = 0
        for r in reqs:
            need = self.pool.pages_needed(r.kv_len, len(r.pages), 1)
            if need:
                pages += max(0, need - self._own_behind(r))
        return pages * self.page_size

    def decode_short(self, reqs, reserve: int) -> bool:
        """Whether the running requests ``reqs`` cannot all take their next token: the full
        pool has fewer than ``reserve`` tokens left, or the windowed pool fewer slots than
        :meth:`swa_decode_reserve`."""
        return self.available_tokens() < reserve or \
            self.swa_available_tokens() < self.swa_decode_reserve(reqs)

    def used_tokens(self) -> int:
        """Tokens in use by requests (their own pages and the tree pages they lock)."""
        return self.pool.capacity_tokens - self.available_tokens()

    # ---- admission ----------------------------------------------------------------------
    def prefix_len(self, req) -> int:
        """Tokens of ``req`` that the tree holds now (no lock taken; for queue ordering)."""
        if not self.enabled or req.prompt_logprobs is not None:
            return 0
        pages, node = self.tree.match_prefix(req.key_tokens(0, req.seq_len - 1), _ns(req))
        if self.swa_pool is not None and pages:
            return self._usable(node, len(pages)) * self.page_size
        return len(pages) * self.page_size

    def _usable(self, node, n: int) -> int:
        """Pages of a match of ``n`` pages ending at ``node`` that the windowed layers can
        continue from (:func:`engine.kv.windowed.usable_prefix_pages`)."""
        return usable_prefix_pages(self.tree.path_swa(node)[:n], self.page_size,
                                   self.swa_pool.window)

    def match(self, req) -> int:
        """Give a request that holds no KV its longest cached prefix, locked; returns the
        prefix length in tokens. At least the last token is left to compute (its logits are
        sampled). Requests that want prompt logprobs match nothing: the prefix's logits would
        be missing."""
        assert not req.pages and req.kv_len == 0
        if self.snapshots is not None:
            req.snap_branch = 0
        if not self.enabled or req.prompt_logprobs is not None:
            return 0
        ids = req.key_tokens(0, req.seq_len - 1)
        pages, node, branch = self.tree.match_branch(ids, _ns(req))
        if self.snapshots is not None and branch - len(pages) * self.page_size \
                >= BRANCH_SNAPSHOT_MIN:
            req.snap_branch = branch
        if pages and self.swa_pool is not None:
            n = self._usable(node, len(pages))
            if n < len(pages):  # cut back to where the windowed keys are still held
                pages, node = self.tree.match_prefix(ids[:n * self.page_size], _ns(req)) \
                    if n else ([], None)
            req.swa_pages = self.tree.path_swa(node) if pages else []
            req.swa_lo = len(pages)
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
        if self.swa_pool is not None:
            req.swa_pages, req.swa_lo = [], 0

    def state_available(self) -> bool:
        """Whether a newly admitted request can take a state slot (always, without a
        recurrent-state pool)."""
        return self.state_pool is None or self.state_pool.available() > 0

    def take_state(self, req) -> None:
        """Give an admitted request a zeroed state slot (``req.state_slot``) if the model
        keeps recurrent states and it holds none. Raises RuntimeError when none is free
        (admission checks :meth:`state_available` first)."""
        if self.state_pool is None or getattr(req, "state_slot", None) is not None:
            return
        slot = self.state_pool.alloc()
        if slot is None:
            raise RuntimeError("no recurrent-state slot is free (admission should have waited)")
        req.state_slot = slot
        if req.cached_pages and self.snapshots is not None:
            # the match ends at a node with a snapshot of the states after exactly kv_len
            self.snapshots.restore(req.last_node.snap, slot)

    def write_prefix(self, req) -> None:
        """Point ``req_to_token`` at the cached prefix of a newly admitted request."""
        if req.kv_len:
            self.req_pool.write(req.req_pool_idx, 0,
                                self.pool.slots_for(req.pages, 0, req.kv_len))
            if self.swa_pool is not None:
                self.swa_req_pool.write(req.req_pool_idx, 0,
                                        self.swa_pool.slots_for(req.swa_pages, 0, req.kv_len))

    # ---- state snapshots (hybrid models) ------------------------------------------------
    def chunk_len(self, req, n: int) -> int:
        """The length of ``req``'s next prefill chunk, given at most ``n`` tokens: with state
        snapshots, cut so that the chunk ends at the next boundary a snapshot is wanted at
        (see the module doc); ``n`` itself without. Never more than ``n``."""
        if self.snapshots is None or n <= 0:
            return n
        ps, start = self.page_size, req.kv_len
        end = start + n
        stops = [b for b in (req.snap_branch, req.seq_len // ps * ps) if start < b < end]
        if stops:
            return min(stops) - start
        if end < req.seq_len and end // ps * ps > start:  # a chunk in the middle: whole pages
            return end // ps * ps - start
        return n

    def snapshot(self, req) -> None:
        """Keep a snapshot of ``req``'s states (its slot, after the step just launched) at
        its ``kv_len`` if that is a page boundary reached with real token ids; it waits on
        the request until its pages are in the tree. Taken only while a snapshot slot is
        free or one of the tree's can be evicted."""
        self.snapshot_rows([req])

    def snapshot_rows(self, reqs, copy: bool = True) -> list[tuple[int, int]]:
        """:meth:`snapshot` of each of ``reqs`` (a step's prefill rows), copied at once;
        returns the ``(state slot, snapshot)`` pairs taken. ``copy=False``: the caller makes
        the copies (the model runner, right after launching the step's forward)."""
        if self.snapshots is None:
            return []
        slots, snaps = [], []
        for req in reqs:
            b = req.kv_len
            if req.state_slot is None or b % self.page_size or self._real_len(req) != b \
                    or (req.state_snaps and req.state_snaps[-1][0] >= b):
                continue
            snap = self.snapshots.alloc()
            if snap is None and self.tree.evict_snapshot():
                snap = self.snapshots.alloc()
            if snap is None:
                break
            slots.append(req.state_slot)
            snaps.append(snap)
            req.state_snaps.append((b, snap))
        if copy:
            self.snapshots.save_many(slots, snaps)
        return list(zip(slots, snaps))

    def _attach_snapshots(self, req, upto: int) -> None:
        """Move ``req``'s waiting snapshots at boundaries <= ``upto`` tokens (its pages there
        are in the tree) onto their nodes."""
        keep = []
        for b, snap in req.state_snaps:
            if b > upto:
                keep.append((b, snap))
            elif not self.tree.attach_snapshot(req.key_tokens(0, b), snap, _ns(req)):
                self.snapshots.free(snap)
        req.state_snaps = keep

    def _drop_snapshots(self, req) -> None:
        for _, snap in req.state_snaps:
            self.snapshots.free(snap)
        req.state_snaps = []

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
        if self.swa_pool is None:
            return self.pool.grow(req.pages, req.kv_len, n)
        held = len(req.pages)
        self._free_behind_window(req)
        slots = self.pool.grow(req.pages, req.kv_len, n)
        if slots is None:
            return None
        new = req.pages[held:]
        short = len(new) - self.swa_pool.num_free_pages
        if short > 0:
            self.tree.evict(0, short)
        twins = self.swa_pool.alloc_pages(len(new))
        if twins is None:  # the windowed pool is short: give the full pages back
            self.pool.free_pages(new)
            del req.pages[held:]
            return None
        for f, w in zip(new, twins):
            self.swa_pool.page_map[f] = w
        req.swa_pages.extend(twins)
        return slots

    def _behind(self, req) -> int:
        """Leading pages of ``req`` that neither its next token's window nor a later match of
        its whole pages needs: those wholly before ``kv_len - W + 1 - page_size`` (a match
        ends at the last whole page, up to a page before ``kv_len``, and reads the window
        before that end)."""
        ps = self.page_size
        return max(0, req.kv_len - self.swa_pool.window + 1 - ps) // ps

    def _own_behind(self, req) -> int:
        """Own windowed pages of ``req`` that its next growth gives back (:meth:`_behind`)."""
        return sum(1 for p in req.swa_pages[req.swa_lo:self._behind(req)] if p)

    def _free_behind_window(self, req) -> None:
        """Give back ``req``'s own windowed pages behind its window (:meth:`_behind`)."""
        cut = self._behind(req)
        lo = req.swa_lo
        if cut > lo:
            sw = req.swa_pages
            self.swa_pool.free_pages([p for p in sw[lo:cut] if p])
            sw[lo:cut] = [0] * (cut - lo)
            req.swa_lo = cut

    def shrink(self, req, new_len: int) -> None:
        """Keep the KV of ``req``'s first ``new_len`` positions only (speculative decoding:
        the slots of rejected draft tokens): the whole pages past them go back to the pool;
        slots past ``new_len`` in the last kept page are rewritten by the next growth."""
        keep = -(-new_len // self.page_size)
        assert req.cached_pages <= keep <= len(req.pages), "shrink below the cached prefix"
        self.pool.free_pages(req.pages[keep:])
        del req.pages[keep:]
        if self.swa_pool is not None:  # held entries from ``keep`` on are its own
            self.swa_pool.free_pages([p for p in req.swa_pages[keep:] if p])
            del req.swa_pages[keep:]
            req.swa_lo = min(req.swa_lo, keep)
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
            if getattr(req, "state_snaps", None):
                self._attach_snapshots(req, req.cached_pages * ps)
            return
        ids = req.key_tokens(0, m * ps)
        # the full pages only: the request keeps its windowed pages (see the module doc)
        n_old, node = self.tree.insert(ids, req.pages[:m], _ns(req),
                                       None if self.swa_pool is None else [0] * m)
        if n_old > req.cached_pages:
            # pages [cached, n_old) duplicate the tree's: switch to the tree's copies
            tree_pages, _ = self.tree.match_kv(ids, _ns(req))
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
        if getattr(req, "state_snaps", None):
            self._attach_snapshots(req, m * ps)

    def _swa_to_insert(self, req, m: int) -> list[int] | None:
        """``req``'s own windowed pages of its first ``m`` pages for ``RadixCache.insert``
        (0 over the tree's part), or None without a windowed pool."""
        if self.swa_pool is None:
            return None
        lo = min(req.swa_lo, m)
        return [0] * lo + req.swa_pages[lo:m]

    def release(self, req, cache: bool = True) -> None:
        """Free a finished, aborted or preempted request's KV. With ``cache`` its computed
        whole pages go into the tree (the next turn of a conversation, or the request itself
        after a preemption, hits them); pass False when the KV may be wrong (a failed step).
        With state snapshots the states at ``kv_len`` go with them when that is a page
        boundary, and the part of the tree past the request's last snapshot is pruned."""
        deepest = req.last_node
        if req.pages:
            ps = self.page_size
            keep = req.cached_pages  # pages [0, keep) are the tree's
            swa_keep = req.swa_lo  # windowed entries [0, swa_keep) are the tree's or freed
            if cache and self.enabled:
                m = self._real_len(req) // ps
                self.snapshot(req)
                sw = self._swa_to_insert(req, m)
                if m > keep or (sw is not None and m > swa_keep):
                    n_old, deepest = self.tree.insert(req.key_tokens(0, m * ps),
                                                      req.pages[:m], _ns(req), sw)
                    self.pool.free_pages(req.pages[keep:n_old])  # duplicates of tree pages
                    keep = max(keep, m)
                    if sw is not None:  # the windowed pages the tree did not take
                        self.swa_pool.free_pages([p for p in sw if p])
                        swa_keep = max(swa_keep, m)
                if getattr(req, "state_snaps", None):
                    self._attach_snapshots(req, m * ps)
            self.pool.free_pages(req.pages[keep:])
            req.pages = []
            if self.swa_pool is not None:
                self.swa_pool.free_pages([p for p in req.swa_pages[swa_keep:] if p])
                req.swa_pages, req.swa_lo = [], 0
        if getattr(req, "state_snaps", None):
            self._drop_snapshots(req)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
            req.last_node = None
        if deepest is not None:
            self.tree.prune(deepest)
        req.cached_pages = 0
        if req.req_pool_idx is not None:
            self.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        if getattr(req, "state_slot", None) is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None
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
        if self.swa_pool is not None:
            self._check_swa(reqs)
        if self.state_pool is not None:
            held = [r.state_slot for r in reqs if getattr(r, "state_slot", None) is not None]
            assert len(set(held)) == len(held), "recurrent-state slot held twice"
            assert len(held) + self.state_pool.available() == self.state_pool.num_slots, (
                f"recurrent-state slots lost: free {self.state_pool.available()} + held "
                f"{len(held)} != pool {self.state_pool.num_slots}")
        if self.snapshots is not None:
            self._check_snapshots(reqs)

    def _check_snapshots(self, reqs) -> None:
        """The snapshot pool's invariant: free + tree + waiting on requests == pool."""
        tree = self.tree.tree_snapshots()
        waiting = [s for r in reqs for _, s in r.state_snaps]
        every = tree + waiting
        assert len(set(every)) == len(every), "state snapshot held twice"
        assert len(every) + self.snapshots.available() == self.snapshots.num_snapshots, (
            f"state snapshots lost: free {self.snapshots.available()} + tree {len(tree)} + "
            f"requests {len(waiting)} != pool {self.snapshots.num_snapshots}")
        assert len(tree) == self.tree.snapshot_count, "radix cache snapshot counter drifted"

    def _check_swa(self, reqs) -> None:
        """The windowed pool's invariant: free + request-owned + tree == pool."""
        free = self.swa_pool.free_page_list()
        tree = self.tree.tree_swa_pages()
        owned = [p for r in reqs for p in r.swa_pages[r.swa_lo:] if p]
        every = free + tree + owned
        assert len(set(every)) == len(every), "windowed KV page counted twice"
        assert len(every) == self.swa_pool.num_pages, (
            f"windowed KV pages lost: free {len(free)} + tree {len(tree)} + requests "
            f"{len(owned)} != pool {self.swa_pool.num_pages}")
        assert len(tree) == self.tree.evictable_swa + self.tree.protected_swa, \
            "radix cache windowed counters drifted"
        for r in reqs:
            if r.pages:
                assert len(r.swa_pages) == len(r.pages), "windowed pages out of step"
