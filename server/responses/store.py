"""The in-memory store of the Responses API (``store: true``, OpenAI's default).

A stored response keeps its ``response`` object (output items, usage, settings), its input
items (what ``GET /v1/responses/{id}/input_items`` lists) and the whole conversation it
answered as Responses input items (the previous responses' items, its input, its output),
which a later request's ``previous_response_id`` continues.

Ids: a stored response's id is made here, by the server (``new_response_id``: ``resp_`` and
48 hex digits from ``secrets``, the length of OpenAI's), never taken from the client: the
``X-Request-Id`` header and the ``rid``/``request_id`` body fields name the engine request,
the logs and the response's ``X-Request-Id`` header only. Knowing a response's id is what
reads, continues, deletes or cancels it, so one client's request id can never reach another
client's response; and ``put`` refuses an id already stored (it never replaces one).

The store lives in the HTTP process, the one process every engine replica of ``--dp-size``
answers through (``server/replicas.py``), so a response stored through one replica is
continued through any. It is bounded three times (SGLang and vLLM keep an unbounded dict):

- ``--responses-store-ttl`` seconds after it was stored (or last updated) a response expires;
- at most ``--responses-store-size`` responses are kept; storing one more evicts the oldest.
  0 turns the store off: ``store: true`` is then answered with ``"store": false``;
- at most ``--responses-store-bytes`` of estimated size (``estimate_size``: the length of the
  JSON of what is kept plus ``CONTAINER_BYTES`` per JSON object or array; measured, that is
  at or above what CPython takes for it, also for inputs of many small items) are kept:
  storing one more evicts the oldest until it fits. A response bigger than the whole budget
  is not stored: it is answered with ``"store": false`` (as with the store off; a stream's
  events, written before its end, said true); a ``background`` one is a 400 naming
  ``background`` before it starts; one that outgrew the budget while it ran in background
  is dropped, like an evicted one. 0 turns the store off.

The request fields a response keeps besides its conversation are bounded at the request
(``metadata``, ``user``...: ``server/openai/field_limits.py``).

An unknown, expired, evicted or deleted id is a 404 naming it. Nothing is written to disk:
a restart loses every stored response (and with it every conversation a client continues by
``previous_response_id``), and background responses still running are cancelled.
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from server.http.errors import APIError, bad_request

#: the prefix of a stored response's id, and the random bytes after it (hex: 48 digits)
RESPONSE_ID_PREFIX, RESPONSE_ID_BYTES = "resp_", 24
#: --responses-store-bytes when not given: 1 GiB of estimated size
DEFAULT_STORE_BYTES = 1 << 30
#: bytes ``estimate_size`` adds per JSON object or array: CPython's dicts and lists (and the
#: small strings in them) take this much more than their JSON text (measured: 35 to 60 bytes
#: for inputs of many small messages, parts or function calls)
CONTAINER_BYTES = 64


def new_response_id() -> str:
    """A fresh, unguessable response id: ``resp_`` + 48 hex digits (192 random bits)."""
    return RESPONSE_ID_PREFIX + secrets.token_hex(RESPONSE_ID_BYTES)


@dataclass
class StoredResponse:
    """One stored response.

    ``response``: the ``response`` object as answered (or as it stands, while a background
    response runs); ``input_items``: this request's input as Responses items, each with an
    ``id``; ``conversation``: every item the next turn continues from (previous turns,
    ``input_items``, then the output items); ``task``: the ``asyncio.Task`` of a background
    response still running, else None; ``live``: while it runs, a callable returning the
    ``response`` object as it stands; ``size``: its ``estimate_size`` in bytes, taken when it
    was stored or last updated.
    """

    response: dict
    input_items: list[dict]
    conversation: list[dict]
    stored_at: float = 0.0
    size: int = 0
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


def estimate_size(st: StoredResponse) -> int:
    """The bytes ``st`` is charged in the store: the length of the JSON of its ``response``,
    ``input_items`` and ``conversation`` (items shared between them, or with the responses
    it continues, are counted in each: the estimate errs high) plus ``CONTAINER_BYTES`` per
    JSON object or array (a ``{`` or ``[`` inside a string counts too). One pass of
    ``json.dumps`` over what is kept (a few ms for a request of a few MB)."""
    text = json.dumps([st.response, st.input_items, st.conversation], default=str,
                      separators=(",", ":"))
    return len(text) + CONTAINER_BYTES * (text.count("{") + text.count("["))


class ResponseStore:
    """A bounded map ``response id -> StoredResponse``, oldest first.

    Args:
        max_items: most responses kept (0: none; ``put`` then stores nothing).
        ttl_s: seconds a response lives after it was stored or last updated.
        max_bytes: most bytes of ``estimate_size`` kept, all responses together (0: none).
        clock: the monotonic clock (tests pass their own).
    """

    def __init__(self, max_items: int, ttl_s: float, max_bytes: int = DEFAULT_STORE_BYTES,
                 clock: Callable[[], float] = time.monotonic):
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.nbytes = 0  # the sum of the kept responses' ``size``
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @classmethod
    def from_args(cls, args) -> ResponseStore:
        """The store of ``ServerArgs`` (``--responses-store-size``, ``-ttl``, ``-bytes``)."""
        return cls(getattr(args, "responses_store_size", 0),
                   getattr(args, "responses_store_ttl", 1.0),
                   getattr(args, "responses_store_bytes", DEFAULT_STORE_BYTES))

    @property
    def enabled(self) -> bool:
        return self.max_items > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def stats(self) -> tuple[int, int]:
        """``(responses kept, their estimated bytes)``, the expired ones dropped first."""
        self._expire()
        return len(self._items), self.nbytes

    def _expire(self) -> None:
        """Drop the expired responses (the oldest come first, so stop at the first live)."""
        now = self.clock()
        while self._items:
            rid, st = next(iter(self._items.items()))
            if now - st.stored_at < self.ttl_s:
                return
            self._drop(rid)

    def _pop(self, rid: str) -> StoredResponse | None:
        st = self._items.pop(rid, None)
        if st is not None:
            self.nbytes -= st.size
        return st

    def _drop(self, rid: str) -> StoredResponse | None:
        st = self._pop(rid)
        if st is not None and st.running:
            st.task.cancel()  # a background response expired or evicted while it ran
        return st

    def _insert(self, st: StoredResponse, refuse_param: str | None) -> bool:
        """Keep ``st`` as the newest and evict the oldest beyond the bounds; False (nothing
        kept) when ``st`` alone is over ``max_bytes``."""
        size = estimate_size(st)
        if size > self.max_bytes:
            if refuse_param is not None:
                raise bad_request(
                    f"this response (about {size} bytes stored) is larger than the response "
                    f"store ({self.max_bytes} bytes, --responses-store-bytes): send it with "
                    "store: false, or a smaller input", refuse_param)
            return False
        st.size, st.stored_at = size, self.clock()
        self._items[st.response["id"]] = st
        self.nbytes += size
        self._expire()
        while len(self._items) > self.max_items or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._items)))  # never st: the newest, and it fits alone
        return True

    def put(self, st: StoredResponse, refuse_param: str | None = None) -> bool:
        """Store ``st`` under its response's id, as the newest; evict the oldest beyond
        ``max_items`` and ``max_bytes``. Returns False (nothing stored) when the store is off
        or ``st`` alone is bigger than ``max_bytes``.

        Raises:
            ValueError: a response is stored under that id already (ids are server-made and
                random: never replaced, whoever asks).
            APIError: 400 naming ``refuse_param``, when given, instead of returning False
                for a response bigger than the whole store.
        """
        if not self.enabled:
            return False
        rid = st.response["id"]
        if rid in self._items:
            raise ValueError(f"response id {rid!r} is stored already; a stored response is "
                             "never replaced")
        return self._insert(st, refuse_param)

    def update(self, st: StoredResponse) -> bool:
        """Store ``st`` again as the newest, its size estimated anew (a background response
        that finished), unless it was deleted, evicted or expired meanwhile; returns whether
        it is kept (False also when it has outgrown ``max_bytes``: it is then dropped)."""
        if self._items.get(st.response["id"]) is not st:
            return False
        self._pop(st.response["id"])  # not cancelled: it is the task that is ending
        return self._insert(st, None)

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
