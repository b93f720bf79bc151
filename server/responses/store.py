"""The in-memory store of the Responses API (``store: true``, OpenAI's default).

A stored response keeps its ``response`` object (output items, usage, settings), its input
items (what ``GET /v1/responses/{id}/input_items`` lists) and the whole conversation it
answered as Responses input items (the previous responses' items, its input, its output),
which a later request's ``previous_response_id`` continues.

The store lives in the HTTP process, the one process every engine replica of ``--dp-size``
answers through (``server/replicas.py``), so a response stored through one replica is
continued through any. It is bounded twice (SGLang and vLLM keep an unbounded dict):

- ``--responses-store-ttl`` seconds after it was stored (or last updated) a response expires;
- at most ``--responses-store-size`` responses are kept; storing one more evicts the oldest.
  0 turns the store off: ``store: true`` is then answered with ``"store": false``.

An unknown, expired, evicted or deleted id is a 404 naming it. Nothing is written to disk:
a restart loses every stored response (and with it every conversation a client continues by
``previous_response_id``), and background responses still running are cancelled.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from server.http.errors import APIError


@dataclass
class StoredResponse:
    """One stored response.

    ``response``: the ``response`` object as answered (or as it stands, while a background
    response runs); ``input_items``: this request's input as Responses items, each with an
    ``id``; ``conversation``: every item the next turn continues from (previous turns,
    ``input_items``, then the output items); ``task``: the ``asyncio.Task`` of a background
    response still running, else None; ``live``: while it runs, a callable returning the
    ``response`` object as it stands.
    """

    response: dict
    input_items: list[dict]
    conversation: list[dict]
    stored_at: float = 0.0
    task: object | None = field(default=None, repr=False)
    live: Callable[[], dict] | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


def not_found(rid: str, param: str = "response_id") -> APIError:
    """The 404 of an unknown, expired or deleted response id."""
    return APIError(f"Response with id '{rid}' not found (never stored, expired, evicted or "
                    "deleted; stored responses live in memory only and are lost at restart)",
                    404, param, "response_not_found")


class ResponseStore:
    """A bounded map ``response id -> StoredResponse``, oldest first.

    Args:
        max_items: most responses kept (0: none; ``put`` then stores nothing).
        ttl_s: seconds a response lives after it was stored or last updated.
        clock: the monotonic clock (tests pass their own).
    """

    def __init__(self, max_items: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_items > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def _expire(self) -> None:
        """Drop the expired responses (the oldest come first, so stop at the first live)."""
        now = self.clock()
        while self._items:
            rid, st = next(iter(self._items.items()))
            if now - st.stored_at < self.ttl_s:
                return
            self._drop(rid)

    def _drop(self, rid: str) -> StoredResponse | None:
        st = self._items.pop(rid, None)
        if st is not None and st.running:
            st.task.cancel()  # a background response expired or evicted while it ran
        return st

    def put(self, st: StoredResponse) -> bool:
        """Store (or update) ``st`` under its response's id, as the newest (replacing, and
        cancelling if it runs, another response stored under that id); evict the oldest
        beyond ``max_items``. Returns False (nothing stored) when the store is off."""
        if not self.enabled:
            return False
        rid = st.response["id"]
        st.stored_at = self.clock()
        if self._items.get(rid) is not st:  # another response under its id (X-Request-Id)
            self._drop(rid)  # is replaced; one still running in background is cancelled
        self._items.pop(rid, None)
        self._items[rid] = st
        self._expire()
        while len(self._items) > self.max_items:
            self._drop(next(iter(self._items)))
        return True

    def update(self, st: StoredResponse) -> bool:
        """``put`` ``st`` again (a background response that finished) unless it was deleted,
        evicted or expired meanwhile; returns whether it was."""
        if self._items.get(st.response["id"]) is not st:
            return False
        return self.put(st)

    def get(self, rid: str, param: str = "response_id") -> StoredResponse:
        """The live stored response ``rid``. Raises: APIError 404 naming ``param``."""
        self._expire()
        st = self._items.get(rid)
        if st is None:
            raise not_found(rid, param)
        return st

    def delete(self, rid: str) -> StoredResponse:
        """Remove ``rid`` (a running background response is cancelled).

        Raises: APIError 404 when it is not stored."""
        self.get(rid)
        return self._drop(rid)

    def snapshot(self, rid: str, param: str = "response_id") -> dict:
        """A copy of the stored ``response`` object of ``rid``. Raises: APIError 404."""
        st = self.get(rid, param)
        return st.live() if st.live is not None else copy.deepcopy(st.response)
