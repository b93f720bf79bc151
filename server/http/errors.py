"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the HTTP layer reports goes through ``APIError`` so the body shape and the
status/type pairing (400 ``invalid_request_error``, 401 ``authentication_error``, 404
``not_found_error``, 408 and 413 ``invalid_request_error``, 503 ``service_unavailable``...)
live in one place.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from starlette.responses import JSONResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to answer with an OpenAI-shaped body.

    Args:
        message: human-readable text (never contains prompt text).
        status: HTTP status code.
        param: the request field at fault, or None.
        code: a machine-readable code (e.g. ``context_length_exceeded``), or None.
        headers: extra response headers (e.g. ``Allow`` on 405).
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers

    @property
    def type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "invalid_request_error" if self.status < 500
                                   else "internal_error")

    def body(self) -> dict:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one server-sent event (a stream's last event before ``[DONE]``)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


def http_error(status: int, message: str | None = None, **kw) -> APIError:
    """An ``APIError`` with the standard reason phrase as the default message."""
    return APIError(message or HTTPStatus(status).phrase, status, **kw)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param, code)


def not_supported(param: str, what: str | None = None) -> APIError:
    """400 for a field ferry cannot honour (yet)."""
    return APIError(f"'{param}' is not supported yet" + (f": {what}" if what else ""), 400,
                    param, "unsupported_parameter")


def unavailable(message: str) -> APIError:
    return APIError(message, 503, None, None)


def context_length_exceeded(max_len: int, prompt_tokens: int, max_tokens: int,
                            param: str, what: str = "for the completion") -> APIError:
    """400 ``context_length_exceeded`` in OpenAI's wording.

    ``what`` says what the completion's ``max_tokens`` tokens are (e.g. "as min_tokens").
    """
    total = prompt_tokens + max_tokens
    return APIError(
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{total} tokens ({prompt_tokens} in the prompt, {max_tokens} {what}). "
        "Please reduce the prompt or the completion length.",
        400, param, "context_length_exceeded")
