"""Output parsers on literal model outputs (no engine): reasoning, content and calls, whole and streamed in random
chunkings, which agree exactly and never show part of a tag; malformed calls stay content; each format reads back
what it renders; forced-call grammars accept the calls the parsers read; the detokenizer keeps a parser's special
tags."""

from __future__ import annotations

import json
import random

import pytest

from server.detokenizer import IncrementalDetokenizer, kept_token_ids
from server.parsers.base import Delta
from server.parsers.grammar import forced_call_grammar
from server.parsers.registry import TOOL_CALL_PARSERS, Parsers
from worker.sampling.params import InvalidGrammarError

TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
    "search": {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "filters": {"type": "object"},
            "limit": {"type": "integer"},
            "exact": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
    },
    "book": {"type": "object", "properties": {"code": {"type": "string"}, "note": {"type": ["string", "null"]}}},
}

# (reasoning parser, tool-call parser, end of the prompt, output, reasoning, content, calls)
CASES = {
    "glm45 reasoning, text, two calls, unicode": (
        "glm45", "glm45", "<|assistant|>",
        "\n<think>用户想知道北京和上海的天气。I should call get_weather twice.</think>\n我来查一下。\n"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n<arg_key>days</arg_key>\n"
        "<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>上海</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>",
        "用户想知道北京和上海的天气。I should call get_weather twice.", "我来查一下。",
        [("get_weather", {"city": "北京", "days": 3}), ("get_weather", {"city": "上海", "unit": "c"})],
    ),
    "glm45 typed values and nested JSON": (
        "glm45", "glm45", "<|assistant|>",
        "<think>Searching.</think>\n<tool_call>search\n<arg_key>query</arg_key>\n"
        '<arg_value>"eaglegate" speculative\ndecoding</arg_value>\n<arg_key>filters</arg_key>\n'
        '<arg_value>{"year": {"gte": 2023}, "langs": ["en", "zh"]}</arg_value>\n<arg_key>limit</arg_key>\n'
        "<arg_value>10</arg_value>\n<arg_key>exact</arg_key>\n<arg_value>true</arg_value>\n<arg_key>tags</arg_key>\n"
        '<arg_value>["ml", "systems"]</arg_value>\n</tool_call>',
        "Searching.", "",
        [("search", {"query": '"eaglegate" speculative\ndecoding', "filters": {"year": {"gte": 2023},
          "langs": ["en", "zh"]}, "limit": 10, "exact": True, "tags": ["ml", "systems"]})],
    ),
    "glm47 without newlines, a string that looks like a number": (
        "glm45", "glm47", "<|assistant|><think>",
        "Need the booking code.</think><tool_call>book<arg_key>code</arg_key><arg_value>007</arg_value>"
        "<arg_key>note</arg_key><arg_value>null</arg_value></tool_call>",
        "Need the booking code.", "", [("book", {"code": "007", "note": None})],
    ),
    "deepseek-r1 without a start tag, two fenced calls": (
        "deepseek-r1", "deepseekv3", "<｜Assistant｜>",
        "The user asks for Tokyo and Paris. I'll call the tool for each.\n</think>\n\nI'll look both up."
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Tokyo", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "The user asks for Tokyo and Paris. I'll call the tool for each.", "I'll look both up.",
        [("get_weather", {"city": "Tokyo", "days": 2}), ("get_weather", {"city": "Paris"})],
    ),
    "deepseekv3 without reasoning, text after the calls": (
        None, "deepseekv3", "<｜Assistant｜>",
        "Checking: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
        '{"query": "naïve Bayes", "filters": {"level": ["intro"]}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\nDone.',
        "", "Checking: \nDone.", [("search", {"query": "naïve Bayes", "filters": {"level": ["intro"]}})],
    ),
    "deepseekv31 thinking prompt, two calls": (
        "deepseek-v3", "deepseekv31", "<｜Assistant｜><think>",
        "Let me search first.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>"
        '{"query": "Zürich café ☕", "filters": {"open": true, "rating": {"min": 4.5}}}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Zürich"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Let me search first.", "",
        [("search", {"query": "Zürich café ☕", "filters": {"open": True, "rating": {"min": 4.5}}}),
         ("get_weather", {"city": "Zürich"})],
    ),
    "deepseek-v3 non-thinking prompt": (
        "deepseek-v3", "deepseekv31", "<｜Assistant｜></think>",
        "Hello! How can I help you today?", "", "Hello! How can I help you today?", [],
    ),
    "qwen3 with hermes calls": (
        "qwen3", "qwen25", "<|im_start|>assistant\n",
        "<think>\nThe user wants the weather in Paris. I'll use get_weather.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "search", "arguments": {"query": "Paris events", "filters": {"date": {"from": "2025-06-01"}}}}\n'
        "</tool_call>",
        "The user wants the weather in Paris. I'll use get_weather.", "",
        [("get_weather", {"city": "Paris", "unit": "c"}),
         ("search", {"query": "Paris events", "filters": {"date": {"from": "2025-06-01"}}})],
    ),
    "qwen3-thinking without a start tag, no call": (
        "qwen3-thinking", "qwen", "<|im_start|>assistant\n",
        "Okay, 2 + 2 is basic arithmetic.\n</think>\n\nThe answer is **4**.",
        "Okay, 2 + 2 is basic arithmetic.", "The answer is **4**.", [],
    ),
    "qwen3 with qwen3_coder calls": (
        "qwen3", "qwen3_coder", "<|im_start|>assistant\n",
        "<think>\nI need to search.\n</think>\n\nI'll search for that.\n<tool_call>\n<function=search>\n"
        "<parameter=query>\nmulti-line\nquery with <b>tags</b>\n</parameter>\n<parameter=limit>\n5\n</parameter>\n"
        '<parameter=filters>\n{"lang": "ja", "nested": {"a": [1, 2]}}\n</parameter>\n</function>\n</tool_call>',
        "I need to search.", "I'll search for that.",
        [("search", {"query": "multi-line\nquery with <b>tags</b>", "limit": 5,
          "filters": {"lang": "ja", "nested": {"a": [1, 2]}}})],
    ),
    "no reasoning end tag": (
        "qwen3", "qwen25", "<|im_start|>assistant\n",
        "<think>\nStill weighing whether to call get_weather or search <tool",
        "Still weighing whether to call get_weather or search <tool", "", [],
    ),
    "a call opened inside reasoning": (
        "qwen3", "qwen25", "<|im_start|>assistant\n<think>\n",
        'I\'ll call the tool.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "I'll call the tool.", "", [("get_weather", {"city": "Oslo"})],
    ),
    "text before a call, no reasoning parser": (
        None, "qwen25", "<|im_start|>assistant\n",
        'Let me check the weather for you.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}'
        "\n</tool_call>",
        "", "Let me check the weather for you.", [("get_weather", {"city": "Lima"})],
    ),
    "think later in an answer stays content": (
        "glm45", None, "<|assistant|>",
        "Use <think> tags, then </think> ends them.", "", "Use <think> tags, then </think> ends them.", [],
    ),
}  # fmt: skip

# malformed calls: the output stays content, exactly as written (after the reasoning)
MALFORMED = {
    "bad JSON": ("qwen25", 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
    "unknown function": ("qwen25", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'),
    "arguments not an object": ("qwen25", '<tool_call>{"name": "search", "arguments": [1]}</tool_call>'),
    "cut-off JSON": ("qwen25", 'Here: <tool_call>\n{"name": "get_weather", "arguments": {"ci'),
    "glm cut off": ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"),
    "glm junk between pairs": (
        "glm45", "<tool_call>get_weather\nplease <arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>"
    ),
    "glm unknown function": ("glm47", "<tool_call>fly<arg_key>to</arg_key><arg_value>Mars</arg_value></tool_call>"),
    "deepseek call without its fence": (
        "deepseekv3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '{"city": "Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    ),
    "deepseekv31 bad JSON": (
        "deepseekv31",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{city: Rome}<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
    ),
    "qwen3_coder no function": ("qwen3_coder", "<tool_call>\n<parameter=city>\nRome\n</parameter>\n</tool_call>"),
    "qwen3_coder cut off": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRo"),
}  # fmt: skip


def _parser(reasoning, tool_call, prompt, tools=TOOLS, mode="auto"):
    parsers = Parsers(reasoning, tool_call)
    return parsers.for_request(mode, tools, parsers.opens_reasoning(prompt))


def _norm(d: Delta) -> tuple:
    return d.reasoning, d.content, [(c.name, json.loads(c.arguments)) for c in d.calls]


def _chunkings(text: str, rng: random.Random, n: int):
    yield list(text)  # a character at a time
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _stream(make, parts: list[str]) -> Delta:
    """Feeds the parts; every step's reasoning and content so far must be a prefix of the final ones."""
    parser, total, steps = make(), Delta(), []
    for part in parts:
        total += parser.feed(part)
        steps.append((total.reasoning, total.content))
    total += parser.finish()
    for reasoning, content in steps:
        assert total.reasoning.startswith(reasoning) and total.content.startswith(content)
    return total


@pytest.mark.parametrize("name", list(CASES))
def test_literal_outputs_parse_whole_and_in_every_chunking_alike(name):
    reasoning, tool_call, prompt, text, *expected = CASES[name]
    make = lambda: _parser(reasoning, tool_call, prompt)  # noqa: E731
    assert _norm(make().parse(text)) == tuple(expected)
    rng = random.Random(sum(map(ord, name)))
    for parts in _chunkings(text, rng, 150):
        assert _norm(_stream(make, parts)) == tuple(expected), parts


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_calls_stay_content(name):
    tool_call, text = MALFORMED[name]
    make = lambda: _parser(None, tool_call, "")  # noqa: E731
    assert _norm(make().parse(text)) == ("", text.strip(), [])
    for parts in _chunkings(text, random.Random(7), 40):
        assert _norm(_stream(make, parts)) == ("", text.strip(), [])


def test_a_partial_tag_waits_and_then_reads_as_what_it_became():
    parser = _parser("qwen3", "qwen25", "")
    assert parser.feed("<thi") == Delta()  # could be <think>
    assert parser.feed("nk>Plan.</th") == Delta(reasoning="Plan.")
    assert parser.feed("ink>Hello <tool_ca") == Delta(content="Hello")
    assert parser.feed("ll") == Delta()  # still could be <tool_call>
    assert parser.feed("ed>") == Delta(content=" <tool_called>")  # it was not
    assert parser.finish() == Delta()


def test_the_builtin_forced_call_is_bare_json_and_a_cut_one_is_content():
    whole = _parser(None, None, "", mode="required").parse('[{"name": "search", "arguments": {"query": "x"}}]')
    assert _norm(whole) == ("", "", [("search", {"query": "x"})])
    assert _norm(_parser(None, None, "", mode="named").parse('{"name": "search", "argu')) == (
        "",
        '{"name": "search", "argu',
        [],
    )
    assert _parser(None, None, "", mode="none") is None  # no parser: the output is content as it is


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_each_format_reads_back_what_it_renders(name):
    fmt = TOOL_CALL_PARSERS[name]
    calls = [("search", {"query": "ünïcode \"quoted\"\nline", "filters": {"a": [1, {"b": None}]}, "limit": 3}),
             ("get_weather", {"city": "Kyiv"})]  # fmt: skip
    text = "Two calls:\n" + "\n".join(fmt.render(n, a) for n, a in calls)
    assert _norm(fmt(TOOLS).parse(text)) == ("", "Two calls:", calls)


def _accepts(ebnf: str, text: str) -> bool:
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(ebnf)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def _openai_tools() -> list[dict]:
    return [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]


@pytest.mark.parametrize("name", ["deepseekv3", "deepseekv31", "glm45", "qwen25", "qwen3_coder"])
def test_forced_call_grammars_accept_the_calls_the_parsers_read(name):
    fmt = TOOL_CALL_PARSERS[name]
    call = fmt.render("get_weather", {"city": "Paris", "days": 3})
    named = forced_call_grammar(fmt, _openai_tools(), "get_weather", parallel=False, reasoning=False)
    assert named.kind == "ebnf" and named.param == "tools"
    assert _accepts(named.source, call)
    assert not _accepts(named.source, fmt.render("search", {"query": "x"}))  # another function than the named one
    assert not _accepts(named.source, "Sure. " + call)  # nothing before the call
    required = forced_call_grammar(fmt, _openai_tools(), None, parallel=False, reasoning=True)
    assert _accepts(required.source, "Paris, then.</think>" + ("\n\n" if name.startswith("qwen") else "") + call)
    parser = Parsers("qwen3", name).for_request("required", TOOLS, opens=True)
    assert _norm(parser.parse("Paris, then.</think>" + call)) == (
        "Paris, then.",
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    )


def test_forced_call_grammars_keep_the_schema_limits():
    deep = {"type": "string"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"a": deep}}
    tools = [{"type": "function", "function": {"name": "deep", "parameters": deep}}]
    with pytest.raises(InvalidGrammarError) as e:
        forced_call_grammar(TOOL_CALL_PARSERS["glm45"], tools, None, parallel=False, reasoning=False)
    assert e.value.param == "tools" and "nests deeper" in str(e.value)


def test_reasoning_starts_open_where_the_template_or_the_parser_says_so():
    assert Parsers("qwen3").opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not Parsers("qwen3").opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert Parsers("deepseek-r1").opens_reasoning("<｜Assistant｜>")
    assert not Parsers(None, "glm45").opens_reasoning("<think>")  # no reasoning parser: all content


def test_the_detokenizer_keeps_a_parsers_special_tags(smol_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_dir / "tokenizer"))
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    ids = tok.encode('Hi<tool_call>{"name": "x"}</tool_call>', add_special_tokens=False) + [tok.eos_token_id]
    keep = kept_token_ids(tok, Parsers(None, "qwen25").markers())
    assert keep == {tok.convert_tokens_to_ids("<tool_call>"), tok.convert_tokens_to_ids("</tool_call>")}
    assert IncrementalDetokenizer(tok).add(ids) == 'Hi{"name": "x"}'  # special tags vanish by default
    kept = IncrementalDetokenizer(tok, keep=keep)
    assert "".join(kept.add([i]) for i in ids) + kept.finish() == 'Hi<tool_call>{"name": "x"}</tool_call>'
    assert kept_token_ids(tok, Parsers("glm45").markers()) == frozenset()  # not tokens of this tokenizer


def test_a_grammar_without_a_reasoning_block_starts_the_output_outside_one(smol_dir):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from server.generation import chat_setup
    from server.parsers.reasoning import ThinkParser
    from server.schemas import ChatCompletionRequest

    engine = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(smol_dir / "tokenizer")))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS["get_weather"]}}]

    def setup(parsers, **body):
        req = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body
        )
        return chat_setup(engine, req, parsers)

    r1 = Parsers("deepseek-r1", "deepseekv3")
    assert setup(r1).make_parser().parse("Hmm.</think>Hi.") == Delta("Hmm.", "Hi.")
    as_json = setup(r1, response_format={"type": "json_object"})  # JSON from the first token: no reasoning
    assert as_json.make_parser().parse('{"a": 1}') == Delta(content='{"a": 1}')
    forced = setup(r1, tools=tools, tool_choice="required")  # the call's grammar closes the reasoning first
    assert forced.grammar.kind == "ebnf" and _accepts(forced.grammar.source, "Hmm.</think>" + _R1_CALL)
    assert _norm(forced.make_parser().parse("Hmm.</think>" + _R1_CALL)) == (
        "Hmm.",
        "",
        [("get_weather", {"city": "Rome"})],
    )
    builtin = setup(Parsers("deepseek-r1"), tools=tools, tool_choice="required")  # bare JSON: no reasoning
    assert _norm(builtin.make_parser().parse('{"name": "get_weather", "arguments": {"city": "Rome"}}')) == (
        "",
        "",
        [("get_weather", {"city": "Rome"})],
    )
    assert ThinkParser(True).parse("<think>\nechoed start tag\n</think>\n\nAnswer") == ("echoed start tag", "Answer")


_R1_CALL = TOOL_CALL_PARSERS["deepseekv3"].render("get_weather", {"city": "Rome"})
