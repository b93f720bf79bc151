"""Response bodies and stream chunks of the generation endpoints (OpenAI shapes).

One ``BaseFormat`` per HTTP request builds either the whole JSON body (``full``) or the SSE
chunks as outputs arrive (``start``, ``chunks``, ``usage_chunk``). Choice ``i`` is engine
request ``i`` of the fan-out (``prompt * n + sample``). A finished choice carries SGLang's
``matched_stop``: the stop string or stop token id (EOS included) that ended it, else null.

With a reasoning parser (``ChatFormat``'s ``reasoning``, a ``ReasoningPlan`` of
``server/pipeline/reasoning.py``) each chat choice's text splits into ``reasoning_content`` and
``content`` as it arrives (``_Choice.answer`` is the content part, what tool calls are
parsed from); the usage adds ``completion_tokens_details.reasoning_tokens``. ``strip``: the
special tokens taken out of the text sent (kept by the engine for a parser that reads them).

Logprobs in a stream travel with their text: a token's logprobs wait while the detokenizer
holds its text back (an incomplete UTF-8 character, a possible stop string), so a chunk may
carry text whose tokens come in a later chunk, until the finish, when every token's
piece is cut to the final text. Each token's ``tokens`` string / chat ``bytes`` is its share of
the returned text (``TokenPieces``), so they concatenate to the text, ``text_offset[i]`` is
where token i's share starts in it (echo, skipped special tokens, stop strings and streams
alike), and concatenating the chunks' logprobs gives exactly the non-stream logprobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from server.openai.logprobs import (
    TokenPieces,
    TokenStrings,
    chat_logprobs,
    clamp,
    completion_logprobs,
    merge_completion_logprobs,
    token_text_bytes,
)
from server.parsers.reasoning import CONTENT
from server.pipeline.reasoning import ReasoningPlan, strip_specials
from server.tokenizer_manager import ReqOutput


def finish_reason_of(out: ReqOutput) -> str | None:
    return None if out.finish_reason is None else str(out.finish_reason.get("type", "stop"))


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's ``usage`` object; ``prompt_tokens_details.cached_tokens`` counts the prompt
    tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class LogprobOptions:
    """What a request asked for. ``k`` is None for no logprobs, else the number of
    alternatives (completions ``logprobs``, chat ``top_logprobs`` or 0)."""

    k: int | None = None
    as_ids: bool = False                 # vLLM's return_tokens_as_token_ids
    echo: bool = False                   # completions only
    prompt_texts: list[str] = field(default_factory=list)     # per choice (echo)
    prompt_ids: list[list[int]] = field(default_factory=list)  # per choice (echo logprobs)
    skip_special_tokens: bool = True     # the request's, for the tokens' share of the text
    spaces_between_special_tokens: bool = True
    prompt_k: int | None = None          # vLLM's prompt_logprobs (needs prompt_ids)
    token_ids: bool = False              # vLLM's return_token_ids (needs prompt_ids)


class _Choice:
    """One choice's accumulated state: token ids and logprob entries pair up by position."""

    __slots__ = ("answer", "byte_pos", "cached_tokens", "completion_tokens", "d_content",
                 "d_reasoning", "entries", "held", "ids", "matched", "offset", "paired",
                 "pieces", "prompt_entries", "prompt_sent", "reasoner", "reasoning",
                 "share_len", "started", "text", "text_bytes")

    def __init__(self):
        self.ids: list[int] = []
        self.entries: list = []
        self.paired = 0           # entries already turned into response logprobs
        self.prompt_entries: list | None = None
        self.prompt_sent = False  # stream: prompt_logprobs went out with a chunk
        self.offset = 0           # legacy text_offset of the next token
        self.started = False
        self.text = ""
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.pieces: TokenPieces | None = None  # each token's share of the text (logprobs)
        self.byte_pos = 0         # chat: bytes of the text given to paired tokens
        self.text_bytes = 0       # UTF-8 bytes of ``text``
        # chat: token i -> the length of its share of the text's bytes (its own bytes may
        # hold the start of a character the text has not released yet)
        self.share_len = None
        self.matched: str | int | None = None  # SGLang's matched_stop
        # chat with a reasoning parser: the split of ``text`` (``reasoner``: its stream);
        # without one ``answer`` is ``text``. ``d_*``: what the last output added to each;
        # ``held``: reasoning a stream holds back (``stream_reasoning: false``)
        self.reasoner = None
        self.reasoning = self.answer = self.d_reasoning = self.d_content = self.held = ""

    def absorb(self, out: ReqOutput) -> tuple[int, int]:
        """Add one output; returns the ``[start, end)`` of newly paired (token, entry).

        With ``pieces``, a token is paired once its share of the text has been released (a
        token whose text the detokenizer holds back waits; with ``share_len``, its share of
        the text's bytes too), and every token at the finish, its piece cut to the final
        text: the paired tokens' pieces always index the text, and their bytes never run
        past it (a stop string may still cut a character whose first bytes a token holds).
        """
        self.ids.extend(out.token_ids)
        if out.finish_reason is not None:
            self.matched = out.finish_reason.get("matched")
        if self.pieces is not None:
            self.pieces.feed(out.token_ids)
        if out.logprobs:
            self.entries.extend(out.logprobs)
        if out.prompt_logprobs is not None and self.prompt_entries is None:
            self.prompt_entries = out.prompt_logprobs
        self.text += out.text
        self.text_bytes += len(out.text.encode("utf-8"))
        self._split(out)
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = max(out.cached_tokens, 0)
        limit = min(len(self.ids), len(self.entries))
        if self.pieces is not None:
            released = self.pieces.base + len(self.text)
            if out.finish_reason is not None:
                self.pieces.clip(released)
            else:
                n, used = self.paired, self.byte_pos
                while n < limit and self.pieces.end_of(n) <= released:
                    if self.share_len is not None:
                        used += self.share_len(n)
                        if used > self.text_bytes:
                            break
                    n += 1
                limit = n
        start, self.paired = self.paired, limit
        return start, self.paired

    def _split(self, out: ReqOutput) -> None:
        """Feed the output's text to the reasoning split (all of it at the finish)."""
        if self.reasoner is None:
            self.d_reasoning, self.d_content = "", out.text
        else:
            r, c = self.reasoner.feed(out.text, len(out.token_ids))
            if out.finish_reason is not None:
                r2, c2 = self.reasoner.finish()
                r, c = r + r2, c + c2
            self.d_reasoning, self.d_content = r, c
        self.reasoning += self.d_reasoning
        self.answer += self.d_content


class BaseFormat:
    """Builds the response body or the stream chunks of one request.

    Args:
        rid: the response id. model: the served model name. count: number of choices.
        prompt_tokens: prompt tokens of the request (each prompt once, whatever ``n``).
        include_usage, continuous_usage: ``stream_options`` (usage chunk at the end; usage
            in every chunk).
        strings: ``TokenStrings`` (token strings for logprobs).
        lp: ``LogprobOptions``.
        n: choices per prompt (choice ``i`` is sample ``i % n`` of prompt ``i // n``); the
            usage counts each prompt's cached tokens once, from its first sample.
    """

    object_full = ""
    object_chunk = ""
    #: where vLLM puts ``prompt_logprobs`` and ``prompt_token_ids``: the body's top level
    #: (chat: every choice has the one prompt) or each choice (completions)
    prompt_fields_top_level = False

    def __init__(self, rid: str, model: str, count: int, prompt_tokens: int,
                 include_usage: bool, continuous_usage: bool = False,
                 strings: TokenStrings | None = None, lp: LogprobOptions | None = None,
                 n: int = 1):
        self.id = rid
        self.model = model
        self.count = count
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.strings = strings if strings is not None else TokenStrings(None)
        self.lp = lp or LogprobOptions()
        self.choices = [_Choice() for _ in range(count)]
        self.n = max(1, n)
        if self.lp.k is not None and self.strings.tokenizer is not None:
            for i, ch in enumerate(self.choices):
                ch.pieces = TokenPieces(self.strings.tokenizer, self.lp.skip_special_tokens,
                                        self.lp.spaces_between_special_tokens,
                                        len(self._prefix(i)))

    def _prefix(self, index: int) -> str:
        """Text the choice's text starts with (completions' echoed prompt)."""
        return ""

    @property
    def texts(self) -> list[str]:
        """Completion text of every choice so far (for --log-requests)."""
        return [c.text for c in self.choices]

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _chunk(self, choices: list) -> dict:
        c = self._envelope(self.object_chunk, choices)
        if self.include_usage:
            c["usage"] = self.usage() if self.continuous_usage else None
        return c

    def usage(self) -> dict:
        return usage_of(self.prompt_tokens, sum(c.completion_tokens for c in self.choices),
                        sum(c.cached_tokens for c in self.choices[::self.n]))

    def usage_chunk(self) -> dict:
        c = self._envelope(self.object_chunk, [])
        c["usage"] = self.usage()
        return c

    def start(self) -> list[dict]:
        return []

    def full(self, outs: list[list[ReqOutput]]) -> dict:
        """The non-stream body; ``outs[i]`` are choice i's outputs in order."""
        choices = []
        for i, seq in enumerate(outs):
            ch = self.choices[i]
            for o in seq:
                ch.absorb(o)
            fin = finish_reason_of(seq[-1]) if seq else "abort"
            choices.append(self._choice(i, ch, fin))
            if self.lp.token_ids:
                choices[-1]["token_ids"] = list(ch.ids)
        body = self._envelope(self.object_full, choices)
        # per choice (completions), or choice 0's at the top (chat); prompt_logprobs is there
        # as null when not asked for, as vLLM's bodies carry it
        prompt: dict[str, list] = {"prompt_logprobs": [
            self.prompt_logprobs(i, c) if self.lp.prompt_k is not None else None
            for i, c in enumerate(self.choices)]}
        if self.lp.token_ids:
            prompt["prompt_token_ids"] = [list(self.lp.prompt_ids[i])
                                          for i in range(len(self.choices))]
        for key, per_choice in prompt.items():
            if self.prompt_fields_top_level:
                body[key] = per_choice[0] if per_choice else None
            else:
                for c, value in zip(choices, per_choice, strict=True):
                    c[key] = value
        body["usage"] = self.usage()
        return body

    def _choice(self, index: int, ch: _Choice, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def prompt_logprobs(self, index: int, ch: _Choice) -> list | None:
        """vLLM's ``prompt_logprobs`` of a choice: per prompt token None (the first) or
        ``{token id: {"logprob", "rank", "decoded_token"}}`` with the prompt token and its
        ``prompt_k`` most likely alternatives (ranks from 1; the prompt token's own rank in
        the vocabulary, computed by the engine, whether it is among them or not)."""
        k = self.lp.prompt_k
        if k is None or not self.lp.prompt_ids:
            return None
        ids = self.lp.prompt_ids[index]
        entries = ch.prompt_entries or [None] * len(ids)
        out: list = []
        for tid, e in zip(ids, entries[:len(ids)], strict=False):
            if e is None:
                out.append(None)
                continue
            d = {}
            for rank, (alt, alt_lp) in enumerate(e[1][:k], 1):
                d[str(alt)] = {"logprob": clamp(alt_lp), "rank": rank,
                               "decoded_token": self.strings.text(alt)}
            d[str(tid)] = {"logprob": clamp(e[0]), "rank": e[2] if len(e) > 2 else
                           d.get(str(tid), {}).get("rank"),
                           "decoded_token": self.strings.text(tid)}
            out.append(d)
        return out

    def chunks(self, out: ReqOutput) -> list[dict]:
        raise NotImplementedError

    def _stream_prompt_logprobs(self, index: int, ch: _Choice, choice: dict) -> None:
        """Stream: add vLLM's ``prompt_logprobs`` to the first chunk of a choice sent once the
        engine has computed them (a chunk whose text the detokenizer held back is not sent,
        so they ride on the next one)."""
        if self.lp.prompt_k is not None and ch.prompt_entries is not None and not ch.prompt_sent:
            choice["prompt_logprobs"] = self.prompt_logprobs(index, ch)
            ch.prompt_sent = True

    def _new_ids(self, out: ReqOutput) -> list[int] | None:
        """vLLM's ``token_ids`` of a stream chunk: the output's new token ids (an EOS or stop
        token id included) when ``return_token_ids`` asked for them, else None."""
        return list(out.token_ids) if self.lp.token_ids else None


class CompletionFormat(BaseFormat):
    """``text_completion`` bodies and chunks; ``echo`` and the legacy ``logprobs`` object."""

    object_full = "text_completion"
    object_chunk = "text_completion"

    def _logprobs(self, index: int, ch: _Choice, start: int, end: int,
                  with_prompt: bool) -> dict | None:
        k = self.lp.k
        if k is None:
            return None
        parts = []
        if with_prompt and self.lp.echo:
            ids = self.lp.prompt_ids[index]
            entries = ch.prompt_entries or [None] * len(ids)
            pp = None
            if ch.pieces is not None:  # the prompt tokens' shares of the echoed prompt,
                # which keeps its special tokens (the prompt verbatim)
                tp = TokenPieces(self.strings.tokenizer, False,
                                 self.lp.spaces_between_special_tokens)
                tp.feed(ids)
                tp.clip(len(self._prefix(index)))
                pp = (tp.pieces, tp.offsets)
            part, ch.offset = completion_logprobs(self.strings, ids, entries[:len(ids)], k,
                                                  ch.offset, self.lp.as_ids, pp)
            parts.append(part)
        pieces = None if ch.pieces is None else (ch.pieces.pieces[start:end],
                                                 ch.pieces.offsets[start:end])
        part, ch.offset = completion_logprobs(self.strings, ch.ids[start:end],
                                              ch.entries[start:end], k, ch.offset,
                                              self.lp.as_ids, pieces)
        parts.append(part)
        return parts[0] if len(parts) == 1 else merge_completion_logprobs(parts)

    def _prefix(self, index: int) -> str:
        return self.lp.prompt_texts[index] if self.lp.echo else ""

    def _choice(self, index, ch, finish_reason):
        return {"index": index, "text": self._prefix(index) + ch.text,
                "logprobs": self._logprobs(index, ch, 0, ch.paired, True),
                "finish_reason": finish_reason, "matched_stop": ch.matched}

    def chunks(self, out):
        ch = self.choices[out.index]
        start, end = ch.absorb(out)
        first = not ch.started
        ch.started = True
        fin = finish_reason_of(out)
        text = (self._prefix(out.index) if first else "") + out.text
        ids = self._new_ids(out)
        if not text and fin is None and start == end and not (first and self.lp.echo) \
                and not ids and not (first and self.lp.token_ids):
            return []
        choice = {"index": out.index, "text": text,
                  "logprobs": self._logprobs(out.index, ch, start, end, first),
                  "finish_reason": fin}
        if ids is not None:
            if first:
                choice["prompt_token_ids"] = list(self.lp.prompt_ids[out.index])
            choice["token_ids"] = ids
        if fin is not None:
            choice["matched_stop"] = ch.matched
        self._stream_prompt_logprobs(out.index, ch, choice)
        return [self._chunk([choice])]


class ChatFormat(BaseFormat):
    """``chat.completion`` bodies and ``chat.completion.chunk`` deltas; chat logprobs."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    prompt_fields_top_level = True

    def __init__(self, *args, reasoning: ReasoningPlan | None = None,
                 strip: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.reasoning = reasoning   # the reasoning split (server/pipeline/reasoning.py)
        self.strip = strip           # special tokens taken out of the text sent
        for ch in self.choices:
            if reasoning is not None:
                ch.reasoner = reasoning.stream()
            if ch.pieces is not None:
                ch.share_len = (lambda i, ch=ch: len(token_text_bytes(
                    self.strings, ch.ids[i], ch.pieces.pieces[i])))

    def _logprobs(self, ch: _Choice, start: int, end: int, final: bool) -> dict | None:
        if self.lp.k is None:
            return None
        shares = None
        if ch.pieces is not None:  # each token's share of the text's bytes
            shares = [token_text_bytes(self.strings, ch.ids[i], ch.pieces.pieces[i])
                      for i in range(start, end)]
            if final:  # cut where the text ends (a stop string, an EOS token left out)
                left = len(ch.text.encode("utf-8")) - ch.byte_pos
                cut = []
                for b in shares:
                    cut.append(b[:max(0, left)])
                    left -= len(cut[-1])
                shares = cut
            ch.byte_pos += sum(map(len, shares))
        return {"content": chat_logprobs(self.strings, ch.ids[start:end],
                                         ch.entries[start:end], self.lp.k, self.lp.as_ids,
                                         shares)}

    def clean(self, text: str) -> str:
        """``text`` without the special tokens the engine kept for a parser."""
        return strip_specials(text, self.strip) if self.strip else text

    def usage(self) -> dict:
        """``BaseFormat.usage``, with a reasoning parser plus
        ``completion_tokens_details.reasoning_tokens``."""
        u = super().usage()
        if self.reasoning is not None:
            u["completion_tokens_details"] = {"reasoning_tokens": sum(
                self.reasoning.reasoning_tokens(c.ids, c.reasoner) for c in self.choices)}
        return u

    def _choice(self, index, ch, finish_reason):
        message = {"role": "assistant", "content": self.clean(ch.answer)}
        if self.reasoning is not None:
            message["reasoning_content"] = (self.clean(ch.reasoning) or None) \
                if self.reasoning.include else None
        return {"index": index, "message": message,
                "logprobs": self._logprobs(ch, 0, ch.paired, True),
                "finish_reason": finish_reason, "matched_stop": ch.matched}

    def _text_delta(self, ch: _Choice, fin: str | None) -> dict:
        """The delta of the text the last output added: ``content`` and, with a reasoning
        parser, ``reasoning_content`` (held back to its end with ``stream_reasoning:
        false``, left out with ``include_reasoning: false``)."""
        plan, r, c = self.reasoning, ch.d_reasoning, self.clean(ch.d_content)
        if plan is None:
            return {"content": c}
        if not plan.include:
            r = ""
        elif not plan.stream_reasoning:
            ch.held += r
            r = ""
            if ch.held and (fin is not None or ch.reasoner.phase == CONTENT):
                r, ch.held = ch.held, ""
        delta = {}
        if r and (r := self.clean(r)):
            delta["reasoning_content"] = r
        if c:
            delta["content"] = c
        return delta

    def _delta(self, index: int, delta: dict, logprobs: dict | None,
               finish_reason: str | None) -> dict:
        return self._chunk([{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish_reason}])

    def start(self):
        chunks = [self._delta(i, {"role": "assistant", "content": ""}, None, None)
                  for i in range(self.count)]
        if self.lp.token_ids and chunks:  # vLLM: on the first chunk, at the top level
            chunks[0]["prompt_token_ids"] = list(self.lp.prompt_ids[0])
        return chunks

    def chunks(self, out):
        ch = self.choices[out.index]
        start, end = ch.absorb(out)
        fin = finish_reason_of(out)
        ids = self._new_ids(out)
        res = []
        delta = self._text_delta(ch, fin)
        text = out.text if self.reasoning is None else delta
        if text or start < end or ids:
            res.append(self._delta(out.index, delta,
                                   self._logprobs(ch, start, end, fin is not None), None))
            if ids is not None:
                res[-1]["choices"][0]["token_ids"] = ids
        if fin is not None:
            res.append(self._delta(out.index, {}, None, fin))
            res[-1]["choices"][0]["matched_stop"] = ch.matched
        if res:
            self._stream_prompt_logprobs(out.index, ch, res[0]["choices"][0])
        return res
