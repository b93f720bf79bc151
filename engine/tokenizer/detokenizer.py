"""The detokenizer process: token ids -> UTF-8-safe text deltas, with stop-string hold-back.

Incremental detokenization keeps two offsets into a request's output ids (the idea of
HF text-generation-inference and vLLM's "prefix/read offset" decoding): the text of the new
tokens is ``decode(ids[prefix:]) - decode(ids[prefix:read])``, so tokenizers whose decode
depends on the previous token (SentencePiece's leading space) still give the right delta,
and a delta is only released when it does not end in U+FFFD (a multi-byte character split
across tokens waits for its last byte).

On top of that, any tail of the text that could be the beginning of a stop string, or grow
into a match of a ``stop_regex`` pattern (partial matching, ``engine/sampling/stops.py``), is
held back, and the text is cut right before the first stop string or pattern match. When a request finishes the
whole output is decoded once more and the missing remainder is sent, so the concatenated
stream equals ``decode(all_ids)`` with trailing U+FFFD removed (a multi-byte character cut
by ``max_tokens``) and cut at the first stop string: the non-stream text.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from engine import io_struct as io
from engine.sampling.stops import compile_patterns, first_match

logger = logging.getLogger("ferry.detokenizer")

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The detokenization state of one request.

    Args:
        tokenizer: a transformers tokenizer (``decode(ids, skip_special_tokens=...)``), or
            None (then every delta is empty: token ids only).
        stop: stop strings; the text never contains one, nor is a possible beginning of one
            released before the request finishes.
        min_tokens: the request's ``min_tokens``: a stop string counts only where it ends in
            the text of generated token ``min_tokens`` or later (the engine's rule), so one
            that ends earlier stays in the text.
        stop_regex: SGLang's stop patterns; the text ends before the first match, and a
            tail that could still grow into one is held back (``matched_regex`` then names
            the pattern). Never combined with ``min_tokens`` (a 400).
        skip_special_tokens, spaces_between_special_tokens: passed to ``decode``. As in
            vLLM, ``spaces_between_special_tokens`` only changes the text for tokenizers
            whose decode puts spaces between added tokens (transformers' slow tokenizers);
            byte-level fast tokenizers (SmolLM2, Llama 3, Qwen) decode the same either way.
    """

    __slots__ = ("floor", "ids", "matched_regex", "max_stop", "min_tokens", "prefix_offset",
                 "prefix_text", "read_offset", "regex", "sent", "skip_special",
                 "spaces_between", "stop", "stopped", "text", "tokenizer")

    def __init__(self, tokenizer, stop: list[str] | None = None,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 min_tokens: int = 0, stop_regex: list[str] | None = None):
        self.tokenizer = tokenizer
        self.regex = compile_patterns(stop_regex) if stop_regex else []
        self.matched_regex: str | None = None
        self.min_tokens = min_tokens
        # characters of the text of the first min_tokens - 1 tokens: a stop string must end
        # beyond them; None until that many tokens are in
        self.floor: int | None = 0 if min_tokens <= 1 else None
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.skip_special = skip_special_tokens
        self.spaces_between = spaces_between_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text: str | None = ""  # decode(ids[prefix:read]); None = not computed
        self.text = ""      # whole characters decoded so far
        self.sent = 0       # characters of ``text`` already released
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special,
                                     spaces_between_special_tokens=self.spaces_between,
                                     clean_up_tokenization_spaces=False)

    def _advance(self) -> None:
        """Extend ``text`` with the characters the ids since ``read_offset`` complete."""
        if self.read_offset >= len(self.ids):
            return
        if self.prefix_text is None:
            self.prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        prefix_text = self.prefix_text
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.prefix_text = None

    def _first_stop(self, text: str, start: int) -> int:
        """Index of the first stop string in ``text[start:]`` (absolute) that ends beyond
        ``floor``, or -1."""
        if self.floor is None and len(self.ids) >= self.min_tokens - 1:
            self.floor = len(self._decode(self.ids[:self.min_tokens - 1]).rstrip(
                REPLACEMENT_CHAR))
        if self.floor is None:
            return -1
        best = -1
        for s in self.stop:
            pos = text.find(s, max(start, self.floor - len(s) + 1))
            if pos != -1 and (best == -1 or pos < best):
                best = pos
        return best

    def _safe_end(self) -> int:
        """How far ``text`` may be released: before a stop string or a possible start of one,
        and before a stop_regex match or a tail that could still grow into one."""
        end = self._string_end()
        if self.regex:
            pos, which = first_match(self.regex, self.text, self.sent, partial=True)
            if which is not None and (pos < end or not self.stopped):  # a complete match
                end, self.stopped, self.matched_regex = pos, True, which
            elif which is None and not self.stopped:  # a tail that could still match
                end = min(end, pos)
        return end

    def _string_end(self) -> int:
        """``_safe_end`` for the stop strings alone."""
        text = self.text
        if not self.stop:
            return len(text)
        pos = self._first_stop(text, self.sent)
        if pos != -1:
            self.stopped = True
            return pos
        for q in range(max(self.sent, len(text) - self.max_stop + 1), len(text)):
            tail = text[q:]
            if any(s.startswith(tail) for s in self.stop):
                return q
        return len(text)

    def step(self, new_ids: list[int], finished: dict | None = None) -> str:
        """Add one message's new token ids; return the text delta to release.

        Args:
            new_ids: token ids generated since the last call.
            finished: None while running, else the engine's finish reason dict. If its
                ``matched`` is an int (EOS or a stop token id), the last id is left out of
                the text.
        Returns:
            The new text (possibly ""). After a finished call the state is spent.
        """
        if self.tokenizer is None:
            return ""
        new_ids = list(new_ids)
        matched = finished.get("matched") if finished is not None else None
        if isinstance(matched, int) and not isinstance(matched, bool) and new_ids:
            new_ids = new_ids[:-1]  # EOS / stop token: counted, never shown
        self.ids.extend(new_ids)
        if self.stopped:
            return ""
        if finished is None:
            self._advance()
            end = self._safe_end()
            delta = self.text[self.sent:end] if end > self.sent else ""
            self.sent = max(self.sent, end)
            return delta
        return self._finish()

    def _finish(self) -> str:
        released = self.text[:self.sent]
        final = self._decode(self.ids)
        if not final.startswith(released):
            # cannot happen for byte-level BPE; keep the stream consistent with what was sent
            logger.warning("final decode disagrees with the incremental text; using the latter")
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            final = self.text + self._decode(self.ids[self.prefix_offset:])[len(prefix_text):]
        # a character cut by the end of generation is dropped, never shown as U+FFFD
        final = final.rstrip(REPLACEMENT_CHAR)
        end = self._first_stop(final, self.sent) if self.stop else -1
        if end == -1:
            end = len(final)
        if self.regex:
            pos, which = first_match(self.regex, final[:end], self.sent, partial=False)
            if which is not None:
                end, self.matched_regex = pos, which
        delta = final[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        self.stopped = True
        return delta


class DetokenizerManager:
    """Per-rid ``IncrementalDetokenizer`` states; turns ``BatchTokenIdOut`` into ``BatchStrOut``.

    A state is created on a rid's first message and freed when it finishes.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer] = {}

    def process(self, b: io.BatchTokenIdOut) -> io.BatchStrOut:
        texts: list[str] = []
        for i, rid in enumerate(b.rids):
            st = self.states.get(rid)
            if st is None:
                st = IncrementalDetokenizer(
                    self.tokenizer, b.stop_strs[i] if i < len(b.stop_strs) else [],
                    b.skip_special_tokens[i] if i < len(b.skip_special_tokens) else True,
                    b.spaces_between_special_tokens[i]
                    if i < len(b.spaces_between_special_tokens) else True,
                    b.min_tokens[i] if i < len(b.min_tokens) else 0,
                    b.stop_regex[i] if i < len(b.stop_regex) else None)
                self.states[rid] = st
            fin = b.finished_reasons[i]
            texts.append(st.step(b.new_token_ids[i], fin))
            if fin is not None:
                del self.states[rid]
        return io.BatchStrOut(rids=b.rids, texts=texts, new_token_ids=b.new_token_ids,
                              finished_reasons=b.finished_reasons,
                              prompt_tokens=b.prompt_tokens,
                              completion_tokens=b.completion_tokens, logprobs=b.logprobs,
                              prompt_logprobs=b.prompt_logprobs, cached_tokens=b.cached_tokens,
                              queue_time_s=b.queue_time_s)


def run_detokenizer_process(server_args, ipc) -> None:
    """Entry point of the detokenizer process (spawned by the server's launcher).

    Loads the tokenizer, binds PULL at ``ipc.detokenizer``, sends ``ReadyOut(rid=
    "detokenizer")`` to ``ipc.server`` and then turns every ``BatchTokenIdOut`` into a
    ``BatchStrOut``. Exits when its parent (the server) is gone.
    """
    import zmq

    from engine.ipc import DETOK_IN, PullSocket, PushSocket

    logging.basicConfig(level=server_args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [detokenizer] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop
    parent = os.getppid()
    try:
        from engine.tokenizer.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
    except Exception as exc:  # noqa: BLE001 - dummy weights without tokenizer files: ids only
        logger.warning("no tokenizer (%s); text outputs will be empty", exc)
        tokenizer = None
    ctx = zmq.Context()
    pull = PullSocket(ctx, ipc.detokenizer, DETOK_IN, bind=True)
    push = PushSocket(ctx, ipc.server)
    push.send(io.ReadyOut(rid="detokenizer"))
    manager = DetokenizerManager(tokenizer)
    try:
        while True:
            msg = pull.recv(timeout_ms=1000)
            if msg is None:
                if os.getppid() != parent:
                    logger.error("server process is gone; detokenizer exits")
                    return
                continue
            push.send(manager.process(msg))
    finally:
        pull.close()
        push.close()
        ctx.term()
