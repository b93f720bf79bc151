"""``parallel_tool_calls`` is implemented, not an accepted no-op: the chat request keeps it,
and completions (which has no tools) refuses it with a 400 naming the field."""

from __future__ import annotations

import pytest

from server.http.errors import APIError
from server.openai.protocol import (
    ACCEPTED_NOOPS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)


def test_parallel_tool_calls_is_implemented_not_a_noop():
    assert "parallel_tool_calls" not in ACCEPTED_NOOPS
    chat = {"messages": [{"role": "user", "content": "x"}]}
    req = parse_request(ChatCompletionRequest, dict(chat, parallel_tool_calls=False))
    assert req.model_extra["parallel_tool_calls"] is False
    with pytest.raises(APIError) as ei:  # completions has no tools
        parse_request(CompletionRequest, {"prompt": "x", "parallel_tool_calls": True})
    assert ei.value.param == "parallel_tool_calls" and ei.value.status == 400
