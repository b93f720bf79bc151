"""Logprobs in OpenAI's two response shapes, and the per-token strings and bytes they carry.

The engine sends, per generated token, ``(logprob, [[token_id, logprob], ...top k])`` (the
log-softmax of the raw logits, as vLLM does by default) and, for ``echo``, one entry per
prompt token (``None`` for the first). This module turns those into:

- the legacy completions object ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}`` (``top_logprobs[i]`` maps token string -> logprob: the top k plus the
  chosen token, so up to k + 1 entries, as OpenAI documents and vLLM does);
- the chat ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` list
  (exactly k alternatives, in rank order; ``[]`` when ``top_logprobs`` was not asked).

Token strings are decoded one token at a time (``decode([id])``, special tokens kept), as
vLLM does, so a character split over several byte-level tokens shows as U+FFFD in each of
their strings; ``bytes`` carries the token's real UTF-8 bytes (byte-level BPE vocabularies
are mapped back through GPT-2's byte-to-unicode table), so joining the ``bytes`` of the
tokens gives the text exactly. ``-inf`` becomes -9999.0 (JSON has no infinity; OpenAI's and
vLLM's floor).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

LOGPROB_FLOOR = -9999.0
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def clamp(lp: float) -> float:
    """A JSON-safe logprob: ``-inf`` (and NaN) -> -9999.0."""
    return max(LOGPROB_FLOOR, lp)


def byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: printable character -> the byte it encodes.

    Source: GPT-2's ``encoder.py`` (Radford et al. 2019): the bytes ``!``..``~``,
    ``¡``..``¬`` and ``®``..``ÿ`` stand for themselves; the other 68 bytes map, in order, to
    the code points 256, 257, ...
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class TokenStrings:
    """Per-token display strings and UTF-8 bytes, cached per token id.

    Args:
        tokenizer: a transformers tokenizer, or None (then every token is ``token_id:N``).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._byte_level = tokenizer is not None and _is_byte_level(tokenizer)
        self._byte_table = byte_level_decoder() if self._byte_level else {}
        added = getattr(tokenizer, "added_tokens_decoder", None) if tokenizer else None
        self._added = set(added) if isinstance(added, dict) else set()

    def text(self, tid: int, as_id: bool = False) -> str:
        """``decode([tid])`` with special tokens kept; ``token_id:N`` if ``as_id`` (vLLM's
        ``return_tokens_as_token_ids``) or there is no tokenizer."""
        if as_id or self.tokenizer is None:
            return f"token_id:{tid}"
        s = self._text.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
            self._text[tid] = s
        return s

    def bytes(self, tid: int) -> bytes:
        """The token's UTF-8 bytes (a partial character's bytes for a split one)."""
        b = self._bytes.get(tid)
        if b is not None:
            return b
        b = None
        if self.tokenizer is not None and tid not in self._added:
            piece = self.tokenizer.convert_ids_to_tokens(tid)
            if isinstance(piece, str):
                if self._byte_level and all(c in self._byte_table for c in piece):
                    b = bytes(self._byte_table[c] for c in piece)
                elif (m := _BYTE_FALLBACK.match(piece)) is not None:  # SentencePiece bytes
                    b = bytes([int(m.group(1), 16)])
        if b is None:
            b = self.text(tid).encode("utf-8")
        self._bytes[tid] = b
        return b


class TokenPieces:
    """Each token's share of the returned text: the characters that token completes, decoded
    incrementally like the detokenizer (``IncrementalDetokenizer``, same special-token
    settings), so the pieces concatenate to the text: a skipped special token's piece is "",
    and a character split over several tokens belongs to the token that completes it.

    ``offsets[i]``/``pieces[i]`` are token i's start in the text and its piece; ``clip``
    cuts them to the final text (a stop string or an EOS token that the text leaves out).

    Args:
        tokenizer: a transformers tokenizer, or None (every piece "").
        skip_special_tokens, spaces_between_special_tokens: as the request's.
        base: the offset of the first token (the echoed prompt's length before completions).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, base: int = 0):
        from engine.tokenizer.detokenizer import IncrementalDetokenizer

        self.dec = IncrementalDetokenizer(tokenizer, None, skip_special_tokens,
                                          spaces_between_special_tokens)
        self.base = base
        self.end = base
        self.pieces: list[str] = []
        self.offsets: list[int] = []

    def feed(self, ids: Sequence[int]) -> None:
        for tid in ids:
            piece = self.dec.step([tid])
            self.pieces.append(piece)
            self.offsets.append(self.end)
            self.end += len(piece)

    def end_of(self, i: int) -> int:
        """Where token i's piece ends (exclusive)."""
        return self.offsets[i] + len(self.pieces[i])

    def clip(self, text_end: int) -> None:
        """Cut every piece to end at most at ``text_end`` (the final text's length)."""
        for i, (o, p) in enumerate(zip(self.offsets, self.pieces, strict=True)):
            self.offsets[i] = min(o, text_end)
            self.pieces[i] = p[:max(0, text_end - o)]
        self.end = min(self.end, text_end)


def completion_logprobs(strings: TokenStrings, ids: Sequence[int], entries: Sequence,
                        k: int, offset: int, as_id: bool = False,
                        pieces: tuple[Sequence[str], Sequence[int]] | None = None
                        ) -> tuple[dict, int]:
    """The legacy completions ``logprobs`` object of some tokens.

    Args:
        strings: ``TokenStrings``.
        ids: token ids, one per entry.
        entries: per token ``(logprob, [[id, logprob], ...])`` from the engine, or None (the
            first prompt token under ``echo``: null logprob and null top_logprobs).
        k: the request's ``logprobs``: how many alternatives to show.
        offset: ``text_offset`` of the first token (characters of the token strings before
            it in this choice).
        as_id: token strings as ``token_id:N``.
        pieces: ``(pieces, offsets)`` from ``TokenPieces``, one per token: then ``tokens``
            are the pieces (unless ``as_id``) and ``text_offset`` the offsets, so they index
            the returned text; the top_logprobs keys stay the tokens' own strings.
    Returns:
        ``({"tokens", "token_logprobs", "top_logprobs", "text_offset"}, next offset)``.
    """
    tokens, lps, tops, offsets = [], [], [], []
    for i, (tid, e) in enumerate(zip(ids, entries, strict=True)):
        s = strings.text(tid, as_id)
        if pieces is not None:
            tokens.append(s if as_id else pieces[0][i])
            offsets.append(pieces[1][i])
            offset = pieces[1][i] + len(pieces[0][i])
        else:
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        if e is None:
            lps.append(None)
            tops.append(None)
            continue
        lp = clamp(e[0])
        lps.append(lp)
        top = {}
        for alt, alt_lp in e[1][:k]:
            top.setdefault(strings.text(alt, as_id), clamp(alt_lp))
        top.setdefault(s, lp)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def merge_completion_logprobs(parts: list[dict]) -> dict:
    """Concatenate legacy ``logprobs`` objects (prompt part, then completion part)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for key, val in out.items():
            val.extend(p[key])
    return out


def chat_logprobs(strings: TokenStrings, ids: Sequence[int], entries: Sequence,
                  k: int, as_id: bool = False,
                  token_bytes: Sequence[bytes] | None = None) -> list[dict]:
    """The chat ``logprobs.content`` entries of some generated tokens.

    Args:
        strings: ``TokenStrings``.
        ids: token ids, one per entry.
        entries: per token ``(logprob, [[id, logprob], ...])`` from the engine.
        k: the request's ``top_logprobs`` (0 when only ``logprobs: true``).
        as_id: token strings as ``token_id:N``.
        token_bytes: each chosen token's share of the text's UTF-8 bytes (``text_bytes``),
            else its own bytes.
    Returns:
        ``[{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]``.
    """

    def item(tid: int, lp: float) -> dict:
        return {"token": strings.text(tid, as_id), "logprob": clamp(lp),
                "bytes": list(strings.bytes(tid))}

    out = []
    for i, (tid, e) in enumerate(zip(ids, entries, strict=True)):
        d = item(tid, e[0])
        if token_bytes is not None:
            d["bytes"] = list(token_bytes[i])
        d["top_logprobs"] = [item(alt, alt_lp) for alt, alt_lp in e[1][:k]]
        out.append(d)
    return out



def token_text_bytes(strings: TokenStrings, tid: int, piece: str) -> bytes:
    """Token ``tid``'s share of the text's UTF-8 bytes, given its ``TokenPieces`` piece: its
    own bytes for a byte-level vocabulary (a split character's partial bytes included), else
    (and for an added/special token: nothing when skipped) the piece's bytes. Joined over a
    choice's tokens, and cut where the text ends, they give the text's bytes exactly."""
    if tid in strings._added or not strings._byte_level:
        return piece.encode("utf-8")
    return strings.bytes(tid)
