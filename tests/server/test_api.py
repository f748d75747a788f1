"""The OpenAI API through the official `openai` client against a real server process."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from devtools.server import API_KEY

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def client(api_server):
    return openai.OpenAI(base_url=api_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient_factory(api_server):
    return lambda: openai.AsyncOpenAI(base_url=api_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_and_completions_non_streaming(client):
    r = _chat(client, "What is the capital of France? Answer in one word.", max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    c = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0)
    assert c.object == "text_completion" and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 6 and c.choices[0].text.startswith(" 5")


def test_streaming_matches_non_streaming_with_usage(client):
    kw = dict(max_tokens=24, temperature=0)
    full = _chat(client, "Name three animals.", **kw)
    stream = _chat(client, "Name three animals.", stream=True, stream_options={"include_usage": True}, **kw)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    comp = client.completions.create(model=MODEL, prompt="The ocean is", max_tokens=10, temperature=0, stream=True)
    ref = client.completions.create(model=MODEL, prompt="The ocean is", max_tokens=10, temperature=0)
    assert "".join(c.choices[0].text for c in comp) == ref.choices[0].text


def test_n_and_seed_reproducibility(client):
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.95, seed=42, n=2)
    a = _chat(client, "Tell me a fun fact.", **kw)
    b = _chat(client, "Tell me a fun fact.", **kw)
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    c = _chat(client, "Tell me a fun fact.", **(kw | {"seed": 7}))
    assert [x.message.content for x in c.choices] != [x.message.content for x in a.choices]


def test_stop_strings_cut_exactly(client):
    prompt = "Count: one, two, three, four, five, six"
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0).choices[0].text
    words = [w for w in ref.split(",") if w.strip()]
    assert len(words) >= 3, ref
    stop = words[2].strip()[:4]
    cut = ref.index(stop)
    for stream in (False, True):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop, "@@@"], stream=stream
        )
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text == ref[:cut]
        assert stop not in text


def test_logprobs(client):
    r = _chat(client, "Say hello.", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].token == tok.token  # greedy picks the most likely token
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)


def test_api_key_required_on_v1_only(api_server):
    bad = openai.OpenAI(base_url=api_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401 and err.value.body["type"] == "authentication_error"
    r = httpx.post(api_server.base_url + "/v1/chat/completions", json={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(api_server.base_url + "/health").status_code == 200
    assert httpx.get(api_server.base_url + "/metrics").status_code == 200
    assert API_KEY not in api_server.output()
    assert API_KEY.encode() not in Path(f"/proc/{api_server.proc.pid}/cmdline").read_bytes()  # read from a file


BAD_BODIES = [
    ("malformed json", b'{"model": "x", "messages": [', None),
    (
        "100 KB stop string",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": "x" * 100_000},
        "stop",
    ),
    ("wrong type", {"model": MODEL, "messages": "hello"}, "messages"),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("empty messages", {"model": MODEL, "messages": []}, "messages"),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    (
        "beyond context",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
        "max_tokens",
    ),
    ("temperature", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature"),
    ("top_p", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": -1}, "top_p"),
    ("n", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 1000}, "n"),
    (
        "max_tokens zero",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        "max_tokens",
    ),
    (
        "top_logprobs",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99},
        "top_logprobs",
    ),
]


@pytest.mark.parametrize("name,body,param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_gets_openai_error_and_server_keeps_serving(api_server, client, name, body, param):
    url = api_server.base_url + "/v1/chat/completions"
    headers = api_server.headers() | {"content-type": "application/json"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url, content=data, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    assert _chat(client, "hi", max_tokens=2, temperature=0).choices[0].finish_reason in ("stop", "length")


def test_body_limits_count_the_bytes_that_arrive(api_server, client):
    """A chunked body has no Content-Length: its bytes are counted as they arrive, and past the limit it is a 413."""
    url = api_server.base_url + "/v1/chat/completions"
    headers = api_server.headers() | {"content-type": "application/json"}

    def chunks(total: int):
        yield b'{"model": "x", "messages": [{"role": "user", "content": "'
        for _ in range(total // 65536):
            yield b"a" * 65536
        yield b'"}]}'

    r = httpx.post(url, content=chunks(10 * 1024 * 1024), headers=headers, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    small = httpx.post(url, content=chunks(65536), headers=headers, timeout=60)
    assert small.status_code == 400 and small.json()["error"]["param"] == "model"  # read whole, then validated
    with socket.create_connection(("127.0.0.1", api_server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 12abc\r\n\r\n{}")
        assert s.recv(200).split(b" ")[1] == b"400"
    assert _chat(client, "hi", max_tokens=2, temperature=0).choices[0].finish_reason in ("stop", "length")


def test_prompt_too_long_for_context(api_server):
    body = {"model": MODEL, "prompt": [5] * 9000, "max_tokens": 1}
    r = httpx.post(api_server.base_url + "/v1/completions", json=body, headers=api_server.headers(), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def _wait_idle(server, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = server.stats()
        if (s["running"], s["waiting"], s["kv_used_tokens"]) == (0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)  # polling for the abort to take effect, bounded by the deadline


def test_disconnect_mid_stream_frees_kv(api_server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", api_server.base_url + "/v1/chat/completions", json=body, headers=api_server.headers(), timeout=60
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(12)]
        assert any(line.startswith("data: ") for line in got)
        busy = api_server.stats()
        assert busy["running"] == 1 and busy["kv_used_tokens"] > 0
    stats = _wait_idle(api_server)
    assert (stats["running"], stats["waiting"], stats["kv_used_tokens"]) == (0, 0, 0)


def test_disconnect_non_streaming_frees_kv(api_server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(api_server.base_url + "/v1/completions", json=body, headers=api_server.headers(), timeout=1.5)
    stats = _wait_idle(api_server)
    assert (stats["running"], stats["waiting"], stats["kv_used_tokens"]) == (0, 0, 0)


def test_32_concurrent_streaming_clients_match_sequential(client, aclient_factory):
    distinct = [f"Give me fact number {i} about the moon." for i in range(8)]
    alone = {p: _chat(client, p, max_tokens=12, temperature=0).choices[0].message.content for p in distinct}
    prompts = distinct * 4  # 32 clients at once, each prompt in four of them (shared prefixes in one batch)
    sequential = [alone[p] for p in prompts]

    async def one(ac, p: str) -> str:
        stream = await ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=12, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them():
        async with aclient_factory() as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    assert asyncio.run(all_of_them()) == sequential


def test_async_client_completions(aclient_factory):
    async def run():
        async with aclient_factory() as ac:
            r = await ac.completions.create(model=MODEL, prompt="Roses are red,", max_tokens=8, temperature=0)
            s = await ac.completions.create(
                model=MODEL, prompt="Roses are red,", max_tokens=8, temperature=0, stream=True
            )
            return r.choices[0].text, "".join([c.choices[0].text async for c in s])

    text, streamed = asyncio.run(run())
    assert text and text == streamed
