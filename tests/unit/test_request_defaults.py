"""The front end's defaults for a request's budget: --max-new-tokens-default caps max_tokens where a request leaves it
out (never past the context), and --request-timeout reaches rank 0 in the sampling parameters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.app import ServerSettings
from server.errors import APIError
from server.generation import sampling_params
from server.schemas import ChatCompletionRequest

CONTEXT = 8192


@pytest.fixture
def engine():
    """What sampling_params reads of an engine: the context length rank 0 reported, and the vocabulary size."""
    return SimpleNamespace(ready=SimpleNamespace(max_model_len=CONTEXT), model_cfg=SimpleNamespace(vocab_size=49152))


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def test_the_default_cap_applies_only_where_max_tokens_is_left_out(engine):
    capped = ServerSettings("m", max_new_tokens_default=1000, request_timeout=30.0)
    params = sampling_params(engine, _request(), 100, None, None, 0, settings=capped)
    assert params.max_new_tokens == 1000 and params.timeout_s == 30.0
    assert sampling_params(engine, _request(), 7700, None, None, 0, settings=capped).max_new_tokens == 492
    assert sampling_params(engine, _request(), 100, 5000, None, 0, settings=capped).max_new_tokens == 5000
    unset = ServerSettings("m")
    params = sampling_params(engine, _request(), 100, None, None, 0, settings=unset)
    assert params.max_new_tokens == CONTEXT - 100 and params.timeout_s is None
    with pytest.raises(APIError, match="exceeds this model's context"):
        sampling_params(engine, _request(), 100, CONTEXT, None, 0, settings=capped)
