"""Grammar-constrained decoding with xgrammar (JSON schema, regex, EBNF).

The constraint of a request is one of ``SamplingParams.json_schema``, ``.regex`` or ``.ebnf``
(SGLang's field names); the server maps OpenAI's ``response_format``, vLLM's ``guided_*`` /
``structured_outputs`` and tool calling onto them (``server/tools/structured.py``).

- ``GrammarBackend`` compiles grammars off the scheduler's thread (a small thread pool) into
  a cache keyed by ``(kind, text)``; the scheduler keeps a request in its grammar queue until
  the future is done (the idea of SGLang's ``grammar_queue``).
- ``GrammarState`` is one request's ``xgrammar.GrammarMatcher``: it fills the request's row of
  the step's token bitmask and accepts each sampled token; a terminated matcher (its stop
  token accepted, or nothing more is allowed) ends the request with ``stop``.
- ``fill_vocab_mask`` / ``apply_vocab_mask``: the per-step mask over the constrained rows
  only; free rows in the same batch are never touched.

The bitmask is xgrammar's: int32 ``[B, ceil(V / 32)]``, bit ``j % 32`` of word ``j // 32`` set
when token ``j`` is allowed. It is filled on the host into a fresh (uninitialised: only the
constrained rows are written and read) buffer, in pinned memory where an accelerator is
present, so its copy to the device is asynchronous; torch's caching host allocator keeps a
block from reuse until its copy is done. xgrammar's own kernels apply it: the CPU one on the
CPU, its Triton one on accelerators where it runs; elsewhere (or if it fails once) a torch
unpack + ``masked_fill`` does (``apply_vocab_mask_torch``, no device-specific call).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and xgrammar load on first use: the server only parses grammars
    import torch

logger = logging.getLogger(__name__)

#: SamplingParams fields that carry a constraint, in the order they are looked at
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
#: compiled grammars kept (LRU) by a backend
GRAMMAR_CACHE_SIZE = 256
_NEG_INF = float("-inf")
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def grammar_key(sp) -> tuple[str, str] | None:
    """``(kind, text)`` of a ``SamplingParams``' constraint, or None when it has none."""
    for kind in GRAMMAR_KINDS:
        text = getattr(sp, kind, None)
        if text is not None:
            return kind, text
    return None


def _clean(exc: Exception) -> str:
    """xgrammar's error text without its ``[time] file.cc:line:`` prefix (first line)."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGR_PREFIX.sub("", msg)


def _grammar(kind: str, text: str):
    import xgrammar as xgr

    if kind == "json_schema":
        # compact JSON (no free whitespace): small models otherwise loop on blanks
        return xgr.Grammar.from_json_schema(text, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def _schema_patterns(node, path: str = "schema"):
    """``(path, regex)`` of every ``pattern`` and ``patternProperties`` key in a parsed JSON
    schema (walked through objects and arrays)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield f"{path}.pattern", value
            elif key == "patternProperties" and isinstance(value, dict):
                for regex, sub in value.items():
                    yield f"{path}.patternProperties", regex
                    yield from _schema_patterns(sub, f"{path}.patternProperties")
            else:
                yield from _schema_patterns(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _schema_patterns(item, f"{path}[{i}]")


def _check_schema_patterns(text: str) -> None:
    """xgrammar's JSON-schema converter drops what its regex engine lacks (lookaround,
    inline flags) with only a warning on stderr, so a ``pattern`` would be
    silently ignored: each one is parsed as the ``regex`` constraint is, and refused the
    same way. Raises ValueError naming the pattern's place."""
    import json

    import xgrammar as xgr

    try:
        schema = json.loads(text)
    except ValueError:
        return  # xgrammar's own parse reports it
    for where, regex in _schema_patterns(schema):
        try:
            xgr.Grammar.from_regex(regex)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and friends
            raise ValueError(f"{where} {regex!r} is not supported: {_clean(exc)}") from None


def check_grammar(kind: str, text: str) -> None:
    """Parse a constraint without a tokenizer (milliseconds): the server's 400 check.

    Args:
        kind: "json_schema" (a JSON schema as a string), "regex" or "ebnf" (xgrammar's
            GBNF-style EBNF with a ``root`` rule).
    Raises:
        ValueError: ``(message, kind)`` in ``args`` when xgrammar rejects it, or (a JSON
            schema) a ``pattern`` its regex engine cannot honour (:func:`_check_schema_patterns`).
    """
    try:
        _grammar(kind, text)
        if kind == "json_schema":
            _check_schema_patterns(text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and friends
        raise ValueError(f"invalid {kind}: {_clean(exc)}", kind) from None


class GrammarBackend:
    """Compiles constraints for one tokenizer and caches them.

    Args:
        tokenizer: the transformers tokenizer of the model.
        vocab_size: V, the width of the model's logits (may exceed the tokenizer's).
        eos_ids: the model's stop tokens (the matcher ends on one of them).
        max_threads: compile threads (xgrammar's own plus the pool's).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], max_threads: int = 2):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self.pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar")
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()

    def _compile(self, kind: str, text: str):
        return self.compiler.compile_grammar(_grammar(kind, text))

    def submit(self, kind: str, text: str) -> Future:
        """The future of the compiled grammar of ``(kind, text)`` (cached; LRU).

        The future's exception, if any, is a ``ValueError((message, kind))``.
        """
        key = (kind, text)
        with self._lock:
            fut = self.cache.get(key)
            if fut is not None:
                self.cache.move_to_end(key)
                return fut
            fut = self.pool.submit(self._compile_checked, kind, text)
            self.cache[key] = fut
            while len(self.cache) > GRAMMAR_CACHE_SIZE:
                self.cache.popitem(last=False)
            return fut

    def _compile_checked(self, kind: str, text: str):
        try:
            return self._compile(kind, text)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"invalid {kind}: {_clean(exc)}", kind) from None


class GrammarState:
    """One request's matcher over a compiled grammar.

    Args:
        compiled: xgrammar's compiled grammar.
        wait_for: the release trigger: a token id (the end-of-thinking tag,
            ``SamplingParams.think_end_id``) or a sequence of token ids (gpt-oss's final
            channel header, ``SamplingParams.think_end_ids``). Until the trigger has been
            accepted (the sequence whole and in order, ending at the latest token) the output
            is free (no mask, every token accepted, never terminated); the grammar applies to
            the tokens after it. None: from the start.
    """

    __slots__ = ("matcher", "failed", "wait_for", "_tail")

    def __init__(self, compiled, wait_for: int | list[int] | tuple[int, ...] | None = None):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.failed = False
        self.wait_for = wait_for
        self._tail: list[int] = []  # the latest tokens, at most len(trigger), while waiting

    def wait_after(self, trigger: list[int] | tuple[int, ...],
                   history: list[int] | tuple[int, ...] = ()) -> None:
        """Wait for the token sequence ``trigger`` (non-empty) before constraining.

        Args:
            trigger: token ids that release the grammar once they were accepted in a row.
            history: the tokens before the first output token (the prompt's end): a
                trigger that ends there releases the grammar at once, one that starts there
                (``<|start|>assistant`` of a generation prompt) counts its tokens.
        Raises:
            ValueError: an empty trigger.
        """
        if not trigger:
            raise ValueError("an empty grammar trigger")
        self.wait_for = tuple(trigger)
        self._tail = list(history[-len(trigger):]) if len(history) else []
        if tuple(self._tail) == self.wait_for:
            self.wait_for, self._tail = None, []

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (its wait is over)."""
        return self.wait_for is None

    def _waited(self, token_id: int) -> None:
        """Advance the wait by one token; ends it when the trigger is complete."""
        trigger = self.wait_for
        if isinstance(trigger, int):
            if token_id == trigger:
                self.wait_for = None
            return
        self._tail.append(token_id)
        if len(self._tail) > len(trigger):
            del self._tail[0]
        if tuple(self._tail) == trigger:
            self.wait_for, self._tail = None, []

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and ``failed`` set) if the grammar rejects it.
        While waiting for the trigger every token is accepted (its last one ends the wait)."""
        if self.wait_for is not None:
            self._waited(token_id)
            return True
        ok = self.matcher.accept_token(token_id)
        if not ok:
            self.failed = True
        return ok

    @property
    def terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row ``row`` of ``bitmask`` (int32 ``[B, ceil(V / 32)]``): the allowed next
        tokens; all of them while the grammar waits (``active`` false)."""
        if not self.active:
            bitmask[row].fill_(-1)  # every bit set: a free row
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)


#: whether host bitmasks go in pinned memory (this machine has an accelerator); set on first use
_PIN: bool | None = None
#: device type -> whether xgrammar's Triton kernel runs there (absent until first tried)
_DEVICE_KERNEL: dict[str, bool] = {}


def _pin_host_buffers() -> bool:
    global _PIN
    if _PIN is None:
        from engine import device as dev

        try:
            _PIN = dev.is_accelerator(dev.resolve_device("auto"))
        except Exception:  # noqa: BLE001 - no usable device: plain memory
            _PIN = False
    return _PIN


def fill_vocab_mask(states: list[GrammarState | None], vocab_size: int
                    ) -> tuple[torch.Tensor, list[int]] | None:
    """The step's bitmask for the constrained rows.

    Args:
        states: one entry per sampled row; None for a free row.
        vocab_size: V.
    Returns:
        ``(bitmask, rows)``: CPU int32 ``[B, ceil(V / 32)]`` (pinned where an accelerator is
        present) and the constrained row indices; only those rows are written (the free
        rows' words are undefined: ``apply_vocab_mask`` never reads them). None when no row
        is constrained (nothing is allocated).
    """
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return None
    import torch

    bitmask = torch.empty((len(states), (vocab_size + 31) // 32), dtype=torch.int32,
                          pin_memory=_pin_host_buffers())
    for i in rows:
        states[i].fill(bitmask, i)
    return bitmask, rows


def apply_vocab_mask(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the disallowed tokens of the constrained rows of ``x`` to -inf, in place.

    Args:
        x: [B, V] float32 logits on any device (a private copy: it is modified).
        bitmask: int32 [B, ceil(V / 32)] on ``x``'s device or the CPU (then copied without
            blocking the host when it is pinned); only the ``rows`` are read.
        rows: the constrained rows.
    """
    import xgrammar as xgr

    V = x.shape[1]
    where = x.device.type
    if where == "cpu":
        xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=V, indices=rows)
        return
    bitmask = bitmask.to(x.device, non_blocking=True)
    if _DEVICE_KERNEL.get(where, True):
        import torch

        idx = None  # every row constrained: no index tensor to copy
        if len(rows) != x.shape[0]:
            idx = torch.tensor(rows, dtype=torch.int32, pin_memory=_pin_host_buffers())
            idx = idx.to(x.device, non_blocking=True)
        try:
            xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=V, indices=idx,
                                            backend="triton")
            _DEVICE_KERNEL[where] = True
            return
        except Exception as exc:  # noqa: BLE001 - no Triton, or a device it does not run on
            if where in _DEVICE_KERNEL:
                raise  # it worked before: a real error
            _DEVICE_KERNEL[where] = False
            logger.info("xgrammar's Triton bitmask kernel does not run on %s (%s); using the "
                        "torch path", where, _clean(exc))
    apply_vocab_mask_torch(x, bitmask, rows)


def apply_vocab_mask_torch(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """``apply_vocab_mask`` in plain torch ops (any device): unpack the 32 bits of each word
    of the constrained rows to a bool [R, V] and ``masked_fill`` their logits, in place."""
    import torch

    V = x.shape[1]
    idx = torch.tensor(rows, dtype=torch.int64).to(x.device, non_blocking=True)
    words = bitmask.to(x.device, non_blocking=True).index_select(0, idx)        # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :V]   # [R, V]
    x.index_copy_(0, idx, x.index_select(0, idx).masked_fill(~allowed, _NEG_INF))
