"""Structured outputs, tool calls and the Responses API through real clients: LangChain and the official `openai`."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from devtools.server import API_KEY

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(api_server):
    return openai.OpenAI(base_url=api_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(api_server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=api_server.base_url + "/v1", api_key=API_KEY, model=MODEL, temperature=0, max_tokens=80, max_retries=0
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(llm, method):
    out = llm.with_structured_output(Person, method=method).invoke(
        "Extract the person as JSON with keys name and age: Carol is 25 years old."
    )
    assert isinstance(out, Person) and out.age == 25


def test_langchain_bind_tools_required(llm):
    from langchain_core.tools import tool

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    msg = llm.bind_tools([multiply], tool_choice="required").invoke("What is 6 times 7?")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "multiply"
    args = msg.tool_calls[0]["args"]
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())


def test_response_format_json_schema_and_json_object(client):
    schema = Person.model_json_schema()
    r = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=60,
        messages=[{"role": "user", "content": "Dave is 31. Give him as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    parsed = client.chat.completions.parse(
        model=MODEL,
        temperature=0,
        max_tokens=60,
        response_format=Person,
        messages=[{"role": "user", "content": "Eve is 52. As JSON."}],
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)
    r = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=120,
        response_format={"type": "json_object"},
        messages=[
            {"role": "user", "content": "Give the weather in Oslo as a JSON object with keys city and temperature."}
        ],
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_calls_non_streaming_and_streamed_as_deltas(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    name, args, finish = None, "", None
    for chunk in stream:
        c = chunk.choices[0]
        for d in c.delta.tool_calls or ():
            assert d.index == 0
            name = d.function.name or name
            args += d.function.arguments or ""
        finish = c.finish_reason or finish
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")
    # the call and its result go back into the history; the model answers in text
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=40)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_responses_create_and_stream(client):
    r = client.responses.create(
        model=MODEL,
        input="What is the capital of France? One word.",
        instructions="Answer briefly.",
        max_output_tokens=10,
        temperature=0,
    )
    assert "Paris" in r.output_text and r.usage.output_tokens <= 10
    with client.responses.stream(
        model=MODEL,
        input=[{"role": "user", "content": "What is the capital of France? One word."}],
        instructions="Answer briefly.",
        max_output_tokens=10,
        temperature=0,
    ) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "Paris" in final.output_text
    tool = {"type": "function", **WEATHER["function"]}
    r = client.responses.create(
        model=MODEL, input="Weather in Rome?", tools=[tool], tool_choice="required", temperature=0, max_output_tokens=40
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    parsed = client.responses.parse(
        model=MODEL, input="Bob is 42.", text_format=Person, temperature=0, max_output_tokens=40
    )
    assert parsed.output_parsed == Person(name="Bob", age=42)


OK_FIELDS = {
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "auto",
    "user": "u1",
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "x"},
    "safety_identifier": "s",
    "prompt_cache_key": "p",
}


def _nested_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BAD_GRAMMARS = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested_schema(400)}}},
        "response_format.json_schema.schema",
    ),
    ({"regex": "[a-z]{1,5000}"}, "regex"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
        "response_format.json_schema.schema",
    ),
    ({"regex": "(unclosed"}, "regex"),
    ({"ebnf": "root ::= "}, "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"no_such_field": 1}, "no_such_field"),
]


@pytest.mark.parametrize("extra,param", BAD_GRAMMARS, ids=[p for _, p in BAD_GRAMMARS])
def test_bad_grammars_and_fields_get_a_400_naming_them(api_server, client, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | extra
    r = httpx.post(api_server.base_url + "/v1/chat/completions", json=body, headers=api_server.headers(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0, extra_body=OK_FIELDS
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


BAD_ITEMS = [
    [{"role": "user", "content": [{"type": "input_text", "text": 5}]}],
    [{"type": "image_generation_call", "id": "x"}],
    [{"type": "function_call", "call_id": "c1"}],
    ["not an item"],
    7,
]


@pytest.mark.parametrize("items", BAD_ITEMS, ids=range(len(BAD_ITEMS)))
def test_malformed_response_items_get_a_400_naming_input(api_server, items):
    body = {"model": MODEL, "input": items, "max_output_tokens": 4}
    r = httpx.post(api_server.base_url + "/v1/responses", json=body, headers=api_server.headers(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_dead_end_grammar_finishes_with_its_reason_and_serving_goes_on(client, smol_engine):
    [token] = smol_engine.encode("Z")
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say Z"}],
        max_tokens=4,
        temperature=0,
        logit_bias={str(token): -100},
        extra_body={"ebnf": 'root ::= "Z"'},
    )
    assert r.choices[0].finish_reason == "grammar_dead_end" and r.choices[0].message.content == ""
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say Z"}],
        max_tokens=4,
        temperature=0,
        extra_body={"ebnf": 'root ::= "Z"'},
    )
    assert r.choices[0].message.content == "Z" and r.choices[0].finish_reason == "stop"


# --- --reasoning-parser / --tool-call-parser: GLM-4.5's format through a speculative server ----------------------
PLAN_TRIP = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "parameters": {
            "type": "object",
            "properties": {"stops": {"type": "array", "items": {"type": "object"}}},
            "required": ["stops"],
        },
    },
}
GLM_OUTPUT = (
    "<think>北京, then a trip.</think>\nBoth.\n"
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n</tool_call>\n"
    '<tool_call>plan_trip\n<arg_key>stops</arg_key>\n<arg_value>[{"city": "Zürich"}]</arg_value>\n</tool_call>'
)
GLM_CALLS = [("get_weather", {"city": "北京"}), ("plan_trip", {"stops": [{"city": "Zürich"}]})]


def _literal(text: str) -> dict:
    """SGLang's `ebnf` extra forcing the model, under real constrained generation, to write `text`."""
    return {"ebnf": "root ::= " + json.dumps(text, ensure_ascii=False)}


@pytest.fixture(scope="module")
def parser_client(smol_dir):
    from devtools.server import ServerProcess
    from speculative.defaults import DEFAULT_HEAD

    server = ServerProcess(  # the shipped head's tree, drafting every step
        ["--dtype", "float32", "--max-total-tokens", "8192", "--speculative-algorithm", "EAGLE3",
         "--speculative-draft-model-path", str(DEFAULT_HEAD), "--speculative-num-steps", "1",
         "--speculative-num-draft-tokens", "2", "--speculative-cost-table", "off",
         "--reasoning-parser", "glm45", "--tool-call-parser", "glm45"],
        api_key=API_KEY,
    )  # fmt: skip
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    assert server.stop() == 0


def test_reasoning_and_calls_parse_in_chat_whole_and_streamed(parser_client):
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Beijing, and a trip?"}],
           "tools": [WEATHER, PLAN_TRIP], "temperature": 0, "max_tokens": 200,
           "extra_body": _literal(GLM_OUTPUT)}  # fmt: skip
    r = parser_client.chat.completions.create(**ask)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert (message.reasoning_content, message.content) == ("北京, then a trip.", "Both.")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == GLM_CALLS
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in parser_client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        assert "<" not in (delta.content or "")  # no tag, whole or partial, reaches content
        content += delta.content or ""
        for d in delta.tool_calls or ():
            name, args = calls.get(d.index, (None, ""))
            calls[d.index] = (d.function.name or name, args + (d.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (message.reasoning_content, message.content, "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls.values()] == GLM_CALLS


def test_a_malformed_call_stays_content(parser_client):
    text = "<tool_call>launch_rocket\n<arg_key>to</arg_key>\n<arg_value>Mars</arg_value>\n</tool_call>"
    r = parser_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Go"}], tools=[WEATHER], temperature=0, max_tokens=80,
        extra_body=_literal(text),
    )  # fmt: skip
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == (
        text,
        None,
        "stop",
    )


def test_responses_have_reasoning_and_function_call_items(parser_client):
    text = (
        "<think>Use the tool.</think>\n"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"
    )
    ask = {"model": MODEL, "input": "Weather in Oslo?", "tools": [{"type": "function", **WEATHER["function"]}],
           "temperature": 0, "max_output_tokens": 120, "extra_body": _literal(text)}  # fmt: skip
    r = parser_client.responses.create(**ask)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == "Use the tool." and r.usage.output_tokens_details.reasoning_tokens > 0
    assert (r.output[1].name, json.loads(r.output[1].arguments)) == ("get_weather", {"city": "Oslo"})
    with parser_client.responses.stream(**ask) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == "Use the tool." and final.output[1].arguments == r.output[1].arguments


def test_a_required_call_is_generated_in_the_parsers_format(parser_client):
    r = parser_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", temperature=0, max_tokens=120,
    )  # fmt: skip
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
