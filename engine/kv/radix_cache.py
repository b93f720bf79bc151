"""The radix prefix cache (SGLang's RadixAttention, Zheng et al. 2023, "Efficiently Programming
Large Language Models using SGLang").

A radix tree over token ids whose nodes own KV pages of the ``KVPool``. A request that starts
with a cached prefix reuses its pages and computes only the rest (an extend step); the extend
kernels read the prefix through ``req_to_token`` as they read any earlier chunk.

Granularity: keys are cut at page boundaries, so a node's key length is a multiple of
``page_size`` and it owns ``len(key) // page_size`` pages. With ``page_size`` 1 every token
is its own page. A child is found by its first page of tokens.

Page states (``check`` proves them after every step in the tests): a page is free (in the
pool's free list), owned by one running request (its pages past ``Req.cached_pages``), or
owned by the tree. A tree page is *locked* while a running request reads it (the node's
``lock_ref`` > 0 on the path from the root to the request's ``last_node``) and *evictable*
otherwise; eviction frees unlocked leaves in least-recently-used order.

Namespaces: a LoRA adapter's KV differs from the base model's for the same tokens, so each
adapter id has a tree of its own (``namespace``, SGLang keys its tree the same way); a prefix
cached under one is never matched under another or under the base model (namespace None).

Windowed layers (``engine/kv/windowed.py``): with a windowed pool each node also keeps
``swa``, its windowed pages parallel to ``pages`` (0 where the positions fell behind a
request's window and their windowed page went back). Those pages follow the node's states
(counted in ``evictable_swa`` / ``protected_swa``) and are freed with it.

State snapshots (a hybrid model's linear-attention layers, ``engine/kv/state_snapshots.py``):
with a snapshot pool a node may also keep ``snap``, a snapshot of the linear layers' states
after exactly the tokens from the root to the node's end. A prefix is only reusable where
such a state exists, so ``match_prefix`` cuts a match back to the deepest node on its path
that has a snapshot (``match_branch`` also says how far the KV alone matched, the branching
point a request may leave a snapshot at). A snapshot is freed with its node (the same LRU
eviction as the pages), protected by the node's lock like its pages, and, when the snapshot
pool runs short, ``evict_snapshot`` drops the least recently used unlocked one (a leaf goes
whole: KV past the last snapshot can never be reused). ``prune`` removes such dead leaves.

``RadixCache(disable=True)`` keeps the same interface and caches nothing (``--disable-radix-
cache``): matches are empty and inserts free what they are given, so the scheduler has no
branches for it.
"""

from __future__ import annotations

import heapq
import itertools
import time

from engine.kv.pool import KVPool
from engine.kv.state_snapshots import StateSnapshotPool


class TreeNode:
    """One edge of the tree: ``key`` token ids (a whole number of pages) and their ``pages``."""

    __slots__ = ("children", "parent", "key", "pages", "swa", "lock_ref", "last_access", "id",
                 "snap")
    _ids = itertools.count()

    def __init__(self, parent: TreeNode | None = None, key: tuple = (), pages: list | None = None,
                 swa: list | None = None):
        self.children: dict[tuple, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.pages: list[int] = pages or []
        self.swa: list[int] | None = swa  # windowed pages parallel to ``pages`` (0: freed)
        self.lock_ref = 0
        self.last_access = time.monotonic()
        self.id = next(TreeNode._ids)
        self.snap: int | None = None  # a state snapshot at the node's end (hybrid models)

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return (self.last_access, self.id) < (other.last_access, other.id)


class RadixCache:
    """Prefix cache over a ``KVPool``.

    Args:
        pool: the KV pool whose pages the tree owns (it frees evicted pages into it).
        disable: cache nothing (same interface).
        swa_pool: the windowed pool (``engine/kv/windowed.py``) whose pages the nodes keep
            beside their full pages, or None.
        snapshots: the state-snapshot pool of a hybrid model's linear layers, or None (a
            match needs no snapshot).
    """

    def __init__(self, pool: KVPool, disable: bool = False, swa_pool: KVPool | None = None,
                 snapshots: StateSnapshotPool | None = None):
        self.pool = pool
        self.swa_pool = swa_pool
        self.snapshots = snapshots
        self.page_size = pool.page_size
        self.disable = disable
        self.reset()

    def reset(self) -> None:
        """Forget the tree (its pages must already be back in the pool: see ``flush``)."""
        self.root = TreeNode()
        self.root.lock_ref = 1  # never evicted
        # one root per namespace (LoRA adapter id; None: the base model)
        self.roots: dict[object, TreeNode] = {None: self.root}
        self.evictable_pages = 0
        self.protected_pages = 0
        self.evictable_swa = 0  # held windowed pages of unlocked / locked nodes
        self.protected_swa = 0
        self.snapshot_count = 0  # state snapshots the nodes hold

    # ---- sizes --------------------------------------------------------------------------
    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def evictable_tokens(self) -> int:
        return self.evictable_pages * self.page_size

    def cached_tokens(self) -> int:
        return self.total_pages * self.page_size

    # ---- keys ---------------------------------------------------------------------------
    def _child_key(self, key: tuple, start: int = 0) -> tuple:
        return key[start:start + self.page_size]

    def _match_len(self, key: tuple, t: tuple, start: int) -> int:
        """Tokens of ``key`` that equal ``t[start:]``, rounded down to whole pages."""
        n = min(len(key), len(t) - start)
        if key[:n] == t[start:start + n]:  # the common case, compared in C
            i = n
        else:
            i = next(j for j in range(n) if key[j] != t[start + j])
        return i - i % self.page_size

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut ``node`` after ``n`` tokens (a page multiple); returns the new upper part."""
        ps = self.page_size
        upper = TreeNode(node.parent, node.key[:n], node.pages[: n // ps],
                         None if node.swa is None else node.swa[: n // ps])
        if node.swa is not None:
            node.swa = node.swa[n // ps:]
        upper.lock_ref = node.lock_ref  # (a snapshot stays with the lower part: its end)
        upper.last_access = node.last_access
        node.parent.children[self._child_key(node.key)] = upper
        node.key = node.key[n:]
        node.pages = node.pages[n // ps:]
        node.parent = upper
        upper.children[self._child_key(node.key)] = node
        return upper

    # ---- match / lock -------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], namespace=None) -> tuple[list[int], TreeNode]:
        """The longest cached prefix of ``token_ids`` in ``namespace``'s tree, in whole pages
        (with a snapshot pool: cut back to the deepest node that has a state snapshot).

        Returns ``(pages, last_node)``: the pages holding the KV of the first
        ``len(pages) * page_size`` tokens, and the node where the match ends (split so
        that it ends exactly there). Touches the matched nodes (LRU).
        """
        pages, node, _ = self.match_branch(token_ids, namespace)
        return pages, node

    def match_branch(self, token_ids: list[int], namespace=None
                     ) -> tuple[list[int], TreeNode, int]:
        """:meth:`match_prefix`, and the tokens the KV alone matched before the cut back to
        a snapshot (the branching point; the match's length without a snapshot pool)."""
        pages, node = self.match_kv(token_ids, namespace)
        full = len(pages) * self.page_size
        if self.snapshots is not None:
            while node.parent is not None and node.snap is None:
                del pages[len(pages) - len(node.pages):]
                node = node.parent
        return pages, node, full

    def match_kv(self, token_ids: list[int], namespace=None) -> tuple[list[int], TreeNode]:
        """The longest prefix of ``token_ids`` whose KV the tree holds (whole pages) and the
        node it ends at (split to end there), snapshots ignored; touches the nodes."""
        node = self.roots.get(namespace)
        if node is None or self.disable or len(token_ids) < self.page_size:
            return [], self.root if node is None else node
        now = time.monotonic()
        pages: list[int] = []
        pos = 0
        ps = self.page_size
        t = tuple(token_ids)
        while len(t) - pos >= ps:
            child = node.children.get(t[pos:pos + ps])
            if child is None:
                break
            n = self._match_len(child.key, t, pos)
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            pos += n
            node = child
            if partial:
                break
        return pages, node

    # ---- state snapshots ----------------------------------------------------------------
    def attach_snapshot(self, token_ids: list[int], snap: int, namespace=None) -> bool:
        """Give the node that ends after ``token_ids`` (a whole number of pages, all in the
        tree: insert them first) the state snapshot ``snap``. Returns False, taking nothing,
        when the tree does not hold them all or that node already has a snapshot (the
        caller frees ``snap``)."""
        if self.snapshots is None or self.disable or len(token_ids) % self.page_size:
            return False
        pages, node = self.match_kv(token_ids, namespace)
        if len(pages) * self.page_size != len(token_ids) or node.parent is None \
                or node.snap is not None:
            return False
        node.snap = snap
        self.snapshot_count += 1
        return True

    def evict_snapshot(self) -> bool:
        """Free the least recently used snapshot of an unlocked node (its node whole when it
        is a leaf, and the leaves without a snapshot that this leaves above it). Returns
        False when every snapshot is locked (or there are none)."""
        held = [n for n in self._nodes() if n.snap is not None and n.lock_ref == 0]
        if not held:
            return False
        node = min(held)
        if node.children:
            self.snapshots.free(node.snap)
            node.snap = None
            self.snapshot_count -= 1
        else:
            parent = node.parent
            self._drop_leaf(node)
            self.prune(parent)
        return True

    def prune(self, node: TreeNode) -> None:
        """With a snapshot pool: remove ``node`` and then its ancestors while each is an
        unlocked leaf without a snapshot (their KV can never be matched)."""
        if self.snapshots is None:
            return
        while node.parent is not None and not node.children and node.lock_ref == 0 \
                and node.snap is None:
            parent = node.parent
            self._drop_leaf(node)
            node = parent

    def tree_snapshots(self) -> list[int]:
        """Every snapshot the tree holds (for the accounting check)."""
        return [n.snap for n in self._nodes() if n.snap is not None]

    def lock(self, node: TreeNode) -> None:
        """A running request reads the pages from the root to ``node``: protect them."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
                if node.swa is not None:
                    held = _held(node.swa)
                    self.evictable_swa -= held
                    self.protected_swa += held
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix cache: unlock without lock"
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
                if node.swa is not None:
                    held = _held(node.swa)
                    self.evictable_swa += held
                    self.protected_swa -= held
            node = node.parent

    # ---- insert -------------------------------------------------------------------------
    def insert(self, token_ids: list[int], pages: list[int], namespace=None,
               swa: list[int] | None = None) -> tuple[int, TreeNode]:
        """Put the KV of ``token_ids`` (``len(pages) * page_size`` tokens) into
        ``namespace``'s tree.

        The pages that extend the tree become the tree's; the caller keeps ownership of
        the rest. Returns ``(n, last_node)``: ``n`` leading pages of the key were already
        in the tree (the caller's pages ``[cached, n)`` are duplicates to free, where
        ``cached`` is how many of them it got from the tree), and the node that ends the
        key. With ``disable``, nothing is taken: ``(len(pages), root)``.

        ``swa`` (with a windowed pool): the caller's windowed pages parallel to ``pages``.
        The new node takes those of its pages; an existing node takes the caller's where it
        holds none (0), and the caller's entry becomes 0 (taken; the caller frees the
        non-zero entries of ``swa[cached:n]`` that are left).
        """
        if self.disable:
            return len(pages), self.root
        ps = self.page_size
        key = tuple(token_ids[: len(pages) * ps])
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = TreeNode()
            node.lock_ref = 1
        pos, now = 0, time.monotonic()
        while pos < len(key):
            child = node.children.get(key[pos:pos + ps])
            if child is None:
                new = TreeNode(node, key[pos:], list(pages[pos // ps:]),
                               None if swa is None else list(swa[pos // ps:len(pages)]))
                node.children[key[pos:pos + ps]] = new
                self.evictable_pages += len(new.pages)
                if swa is not None:
                    self.evictable_swa += _held(new.swa)
                    swa[pos // ps:] = [0] * (len(swa) - pos // ps)
                return pos // ps, new
            n = self._match_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            if swa is not None:
                self._fill_swa(child, swa, pos // ps)
            child.last_access = now
            pos += n
            node = child
        return len(pages), node

    def _fill_swa(self, node: TreeNode, swa: list[int], first: int) -> None:
        """Give ``node`` the caller's windowed pages ``swa[first:]`` where it holds none."""
        for k, p in enumerate(node.swa):
            q = swa[first + k]
            if not p and q:
                node.swa[k] = q
                swa[first + k] = 0
                if node.lock_ref:
                    self.protected_swa += 1
                else:
                    self.evictable_swa += 1

    def path_swa(self, node: TreeNode) -> list[int]:
        """The windowed pages from the root to ``node``, in position order (0: not held)."""
        parts = []
        while node.parent is not None:
            parts.append(node.swa or [0] * len(node.pages))
            node = node.parent
        return [p for part in reversed(parts) for p in part]

    # ---- evict / flush ------------------------------------------------------------------
    def evict(self, num_pages: int, swa_pages: int = 0) -> int:
        """Free at least ``num_pages`` pages (and ``swa_pages`` windowed pages) of unlocked
        leaves, least recently used first (fewer when not enough are evictable). Returns
        the pages freed."""
        if (num_pages <= 0 and swa_pages <= 0) or self.evictable_pages == 0:
            return 0
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = swa_freed = 0
        while (freed < num_pages or swa_freed < swa_pages) and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            n, n_swa = self._drop_leaf(leaf)
            freed += n
            swa_freed += n_swa
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _drop_leaf(self, leaf: TreeNode) -> tuple[int, int]:
        """Free an unlocked leaf's pages, windowed pages and snapshot and unlink it; returns
        the pages and windowed pages freed."""
        self.pool.free_pages(leaf.pages)
        self.evictable_pages -= len(leaf.pages)
        held = []
        if leaf.swa is not None:
            held = [p for p in leaf.swa if p]
            self.swa_pool.free_pages(held)
            self.evictable_swa -= len(held)
        if leaf.snap is not None:
            self.snapshots.free(leaf.snap)
            leaf.snap = None
            self.snapshot_count -= 1
        del leaf.parent.children[self._child_key(leaf.key)]
        return len(leaf.pages), len(held)

    def flush(self) -> bool:
        """Free every page of the tree; refused (False) while a request holds a lock."""
        if self.protected_pages:
            return False
        self.evict(self.evictable_pages)
        self.reset()
        return True

    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            n = stack.pop()
            if n.parent is not None:
                yield n
            stack.extend(n.children.values())

    def tree_pages(self) -> list[int]:
        """Every page the tree owns (for the accounting check)."""
        return [p for n in self._nodes() for p in n.pages]

    def tree_swa_pages(self) -> list[int]:
        """Every windowed page the tree holds (for the accounting check)."""
        return [p for n in self._nodes() for p in (n.swa or ()) if p]


def _held(swa: list[int]) -> int:
    """Windowed pages held in a node's list (its non-zero entries)."""
    return len(swa) - swa.count(0)
