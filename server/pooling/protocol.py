"""The request bodies of the pooling endpoints and their bounds.

- ``/v1/embeddings`` (OpenAI): ``input`` a string, a list of strings, a list of token ids
  or a list of such lists (at most ``MAX_INPUTS``, OpenAI's 2048); ``encoding_format``
  ``float`` or ``base64`` (little-endian float32, as OpenAI); ``dimensions``; ``user``
  (bounded as on the other routes, ``server/openai/field_limits.py``).
- ``/v1/rerank``, ``/rerank`` (Cohere, Jina, vLLM): ``query``, ``documents`` (strings or
  ``{"text": ...}`` objects, at most ``MAX_DOCUMENTS``), ``top_n``, ``return_documents``.
- ``/v1/score`` (vLLM): ``text_1`` and ``text_2``, a string or a list each (one against
  many, or pairwise).

``instruction`` (rerank and score) is ferry's extension for yes/no rerankers: the
``<Instruct>`` of Qwen3-Reranker's prompt (default: its model card's web-search one).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: the most inputs of one /v1/embeddings request (OpenAI's limit)
MAX_INPUTS = 2048
#: the most documents of one rerank request, and pairs of one /v1/score request
MAX_DOCUMENTS = 1024
#: the longest instruction (characters)
MAX_INSTRUCTION_LEN = 4096


class _Body(BaseModel):
    # strict: no coercion (a "3" is not an int); unknown fields are a 400 naming them
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``."""

    model: str | None = None
    input: (str | list[str] | list[int] | list[list[int]])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # bounded by check_fields (OpenAI's wording)

    @field_validator("input")
    @classmethod
    def _bounded(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        n = 1 if isinstance(value, str) or isinstance(value[0], int) else len(value)
        if n > MAX_INPUTS:
            raise ValueError(f"{n} inputs; at most {MAX_INPUTS} per request")
        if any(isinstance(v, list) and not v for v in value if not isinstance(value, str)):
            raise ValueError("an input's token ids must not be empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per input: a string, or token ids."""
        if isinstance(self.input, str) or isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)


class TextDocument(_Body):
    text: str


class RerankRequest(_Body):
    """``POST /v1/rerank`` and ``/rerank``."""

    model: str | None = None
    query: str
    documents: list[str | TextDocument] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    instruction: str | None = Field(None, max_length=MAX_INSTRUCTION_LEN)
    user: str | None = None  # bounded by check_fields (OpenAI's wording)

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Body):
    """``POST /v1/score``."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = Field(None, max_length=MAX_INSTRUCTION_LEN)
    user: str | None = None  # bounded by check_fields (OpenAI's wording)

    def pairs(self) -> list[tuple[str, str]]:
        """The (text_1, text_2) pairs: one text_1 against every text_2, or pairwise.

        Raises: ValueError (a 400 naming ``text_1``) for lists of unequal lengths."""
        firsts = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        seconds = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds) or not seconds:
            raise ValueError(f"text_1 has {len(firsts)} entries and text_2 {len(seconds)}: "
                             "send one text_1, or as many as text_2 (at least one)")
        if len(seconds) > MAX_DOCUMENTS:
            raise ValueError(f"{len(seconds)} pairs; at most {MAX_DOCUMENTS} per request")
        return list(zip(firsts, seconds))


# ---- the answers (their /openapi.json schemas) ---------------------------------------------

class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(_Out):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(_Out):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: PoolingUsage


class RerankResult(_Out):
    index: int
    relevance_score: float
    document: TextDocument | None = None


class RerankResponse(_Out):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


class ScoreData(_Out):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(_Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
