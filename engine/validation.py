"""The checks every generation request passes, in one place.

The HTTP server (``TokenizerManager.check_prompt``), the engine process
(``EngineLoop.validate``) and the offline ``LLM.generate`` all call ``validate_request`` and
turn its ``RequestError`` into their own error form: an OpenAI 400 body, an ``io.ErrorOut``,
or the ``ValueError`` itself. The context-length message follows OpenAI's wording.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.sampling.params import SamplingParams

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class RequestError(ValueError):
    """A request the engine cannot serve as asked (an HTTP 400).

    Args:
        message: human-readable text (never contains prompt text); ``str(exc)`` is this.
        param: the request field at fault (``prompt``, ``max_tokens``, ``temperature``...),
            or None.
        code: a machine-readable code (``context_length_exceeded``), or None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def context_length_message(max_context_len: int, prompt_tokens: int, completion_tokens: int,
                           what: str = "for the completion") -> str:
    """OpenAI's ``context_length_exceeded`` text.

    Args:
        max_context_len: the context (tokens).
        prompt_tokens: tokens in the prompt.
        completion_tokens: tokens asked beyond the prompt; ``what`` says what they are
            (e.g. "as min_tokens").
    """
    return (f"This model's maximum context length is {max_context_len} tokens. However, you "
            f"requested {prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the "
            f"prompt, {completion_tokens} {what}). Please reduce the prompt or the completion "
            "length.")


def check_logit_bias(logit_bias: dict[int, float], vocab_size: int | None) -> None:
    """Every ``logit_bias`` key must be a token id in ``[0, vocab_size)``.

    Raises:
        RequestError: naming every bad key (in increasing order) and the vocabulary size,
            param ``logit_bias``. A ``vocab_size`` of None or 0 skips the check.
    """
    if not vocab_size:
        return
    bad = sorted(t for t in logit_bias if not 0 <= t < vocab_size)
    if bad:
        keys = ", ".join(str(t) for t in bad)
        raise RequestError(f"logit_bias: token id{'s' if len(bad) > 1 else ''} {keys} "
                           f"{'are' if len(bad) > 1 else 'is'} outside the vocabulary "
                           f"(vocabulary size {vocab_size}: ids 0 to {vocab_size - 1})",
                           "logit_bias")


def verify_sampling(sampling_params: SamplingParams, vocab_size: int | None) -> None:
    """``SamplingParams.verify`` with ``check_logit_bias`` first (its message names every
    bad key; verify's names the first).

    Raises:
        RequestError: the first bound a field breaks (``param`` names it).
    """
    check_logit_bias(sampling_params.logit_bias, vocab_size)
    try:
        sampling_params.verify(vocab_size or None)
    except ValueError as exc:  # verify raises ValueError(message, param)
        msg, field = (exc.args + (None, None))[:2]
        raise RequestError(str(msg), field) from None


def validate_request(input_ids: Sequence[int], sampling_params: SamplingParams,
                     vocab_size: int | None, max_context_len: int, param: str = "prompt", *,
                     max_tokens_param: str | None = "max_tokens",
                     clamp_max_tokens: bool = False) -> int:
    """Check one tokenized generation request against the model's limits.

    The checks, in order: the sampling bounds (``verify_sampling``), a non-empty
    prompt, every token id in ``[0, vocab_size)``, prompt + ``max_tokens`` within the
    context (``max_tokens`` None counts as 1: "up to the context"), and prompt +
    ``min_tokens`` within the context.

    Args:
        input_ids: the prompt's token ids (ints).
        sampling_params: the request's settings.
        vocab_size: the model's vocabulary size; None or 0 skips the token-id check.
        max_context_len: the usable context (tokens), prompt and completion together.
        param: the prompt's field, named by prompt errors (``prompt``, ``messages``).
        max_tokens_param: the field the client set ``max_tokens`` with (``max_tokens``,
            ``max_completion_tokens``), or None when ``max_tokens`` is a default, not the
            client's: then a context overflow always names ``param``.
        clamp_max_tokens: the offline ``LLM`` rule: a ``max_tokens`` beyond the room the
            prompt leaves is cut to that room instead of raising (the prompt must still
            leave room for one token).
    Returns:
        the completion's token budget: ``max_tokens``, or the room left by the prompt when
        ``max_tokens`` is None (or larger, with ``clamp_max_tokens``).
    Raises:
        RequestError: a ``ValueError`` with ``param`` and ``code``. A context overflow has
            code ``context_length_exceeded`` and names ``param`` when the prompt leaves no
            room for one token, ``max_tokens_param`` when the prompt fits but not with the
            asked ``max_tokens``, and ``min_tokens`` when prompt + min_tokens does not fit.
    """
    sp = sampling_params
    verify_sampling(sp, vocab_size)
    if not input_ids:
        raise RequestError("the prompt is empty", param)
    if vocab_size and (min(input_ids) < 0 or max(input_ids) >= vocab_size):
        bad = next(t for t in input_ids if t < 0 or t >= vocab_size)
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                           param)
    n, ctx = len(input_ids), max_context_len
    room = ctx - n
    max_tokens = sp.max_tokens
    if clamp_max_tokens and max_tokens is not None and room >= 1:
        max_tokens = min(max_tokens, room)
    need = 1 if max_tokens is None else max_tokens
    if need > room:
        at_fault = max_tokens_param if room >= 1 and max_tokens_param else param
        raise RequestError(context_length_message(ctx, n, need), at_fault,
                           CONTEXT_LENGTH_EXCEEDED)
    if sp.min_tokens > room:
        raise RequestError(context_length_message(ctx, n, sp.min_tokens, "as min_tokens"),
                           "min_tokens", CONTEXT_LENGTH_EXCEEDED)
    return room if max_tokens is None else max_tokens


def pooling_mismatch(engine_pooling, pooling: bool) -> str | None:
    """The error for a request the engine's kind does not serve, else None.

    Args:
        engine_pooling: the engine's ``PoolingSpec`` (None: a generation engine).
        pooling: the request is a pooling one (an embedding or a score).
    """
    if engine_pooling is not None and not pooling:
        return ("this engine serves a pooling model (embeddings or scores): it does not "
                "generate text")
    if engine_pooling is None and pooling:
        return ("this engine serves a generation model: it has no embeddings or scores "
                "(serve an embedding model, or pass --is-embedding)")
    return None


def images_for(model, images, n_tokens: int):
    """A request's images checked and unpacked (``engine.mm_inputs.build_mm_inputs``) for
    ``model``, whose ``accepts_images`` says whether it reads them (and
    ``bidirectional_images`` whether its language model attends bidirectionally within an
    image: ``MMInputs.bidirectional``).

    Args:
        model: the served model (a ``CausalLM``).
        images: the request's ``engine.io_struct.ImageData`` (or objects with its fields).
        n_tokens: the prompt's length.
    Returns:
        an ``engine.mm_inputs.MMInputs``.
    Raises:
        RequestError: a model without image input (param ``messages``), or image data that
            does not fit the prompt or the model's encoder (``check_images``; param
            ``images``).
    """
    from engine.mm_inputs import build_mm_inputs

    if not getattr(model, "accepts_images", False):
        why = getattr(model, "images_off_reason", None)  # an image model serving text only
        raise RequestError(why or f"this model ({type(model).__name__}) does not read images; "
                           "send text only", "messages")
    try:
        mm = build_mm_inputs(images, n_tokens)
    except ValueError as exc:
        raise RequestError(str(exc.args[0]), "images") from None
    check = getattr(model, "check_images", None)
    if check is not None:
        try:
            check(mm.items)
        except ValueError as exc:
            raise RequestError(str(exc.args[0]), "images") from None
    mm.bidirectional = bool(getattr(model, "bidirectional_images", False))
    return mm
