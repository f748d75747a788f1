"""Grammar-constrained decoding on the engine: 50 generated JSON schemas validate with speculation on and off, at
tp=1 and tp=3; EAGLE's constrained output is identical to plain constrained output; dead ends finish cleanly."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from devtools.prompts import chat
from devtools.schemas import slow_schema
from runtime.engine import Engine
from speculative.defaults import DEFAULT_HEAD
from worker.config import EngineConfig, SpecConfig
from worker.protocol import FINISH_DEAD_END
from worker.sampling.grammar import check_grammar
from worker.sampling.params import GrammarSpec, InvalidGrammarError, SamplingParams

WORDS = ["city", "score", "label", "owner", "color", "size", "kind", "count", "title", "level", "price", "tags"]


def _leaf(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(
        ["string", "integer", "number", "enum", "boolean", "array", "object"]
        if depth < 2
        else ["string", "integer", "number", "enum", "boolean"]
    )
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.choice([8, 16])}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([9, 100, 1000])}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no", "alpha", "beta"], 3)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": _leaf(rng, depth + 1), "minItems": 1, "maxItems": 3}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 3 if depth else 4))
    props = {n: _leaf(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


SCHEMAS = [_object(random.Random(i)) for i in range(32)]


def _requests(engine: Engine, count: int = len(SCHEMAS)):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS[:count]):
        fields = ", ".join(schema["properties"])
        prompts.append(engine.encode(chat(engine, f"Describe item {i} as JSON with the fields {fields}.")))
        params.append(
            SamplingParams(max_new_tokens=400, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(schema)))
        )
    return prompts, params


def _assert_valid(results) -> None:
    for schema, r in zip(SCHEMAS, results):
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        jsonschema.validate(json.loads(r.text), schema)


def _spec(**kw) -> SpecConfig:  # every step drafts: calibration is not under test here
    return SpecConfig("EAGLE3", str(DEFAULT_HEAD), **({"cost_table": "off"} | kw))


def test_random_schemas_validate_without_speculation(served_engine):
    """A sample, on the default model as served (quantized weights, this CPU's kernel): grammars are applied to
    logits on rank 0 whatever the dtype, and this engine decodes several times faster than float32. The whole set
    runs with speculation below, where drafts meet the grammar."""
    _assert_valid(served_engine.generate(*_requests(served_engine, 12)))


@pytest.mark.parametrize("tp", [1, 3])
def test_random_schemas_validate_with_speculation(smol_dir, tp):
    """The default serving setup (quantized weights, cost-aware tree, context drafts) with grammars on rank 0; at
    tp=3 the followers run the same steps and never see a grammar. (tp=3 without speculation runs the same rank-0
    code as tp=1 without it, and costs two more minutes on two cores: not repeated here.)"""
    count = len(SCHEMAS) if tp == 1 else 3  # two cores run three ranks: a sample at tp=3
    with Engine(EngineConfig(tp_size=tp, max_total_tokens=32768, spec=_spec(disable_batch_size=0))) as eng:
        _assert_valid(eng.generate(*_requests(eng, count)))
        stats = eng.stats.values
    assert stats["spec_verify_steps"] > 0 and stats["rank_divergences"] == 0


# the draft head was trained on prose: codes like these make it propose tokens the grammar forbids, step after step
ADVERSARIAL = GrammarSpec(
    "json_schema",
    json.dumps(
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["code", "parts"],
            "properties": {
                "code": {"type": "string", "pattern": "[QXZ]{2}-[0-9]{3}-[qxz]{4}"},
                "parts": {"type": "array", "minItems": 2, "maxItems": 3, "items": {"enum": ["zzq", "xqx", "qqz-9"]}},
            },
        }
    ),
)
IDENTITY = [
    ("Give a person as JSON.", GrammarSpec("json_schema", json.dumps(SCHEMAS[0]))),
    ("Describe the weather in Paris as JSON.", GrammarSpec("json_object")),
    ("Write a product code.", ADVERSARIAL),
    ("Is the sky blue? Answer yes or no, then explain.", GrammarSpec("regex", r"(yes|no), because [a-z ]{1,40}\.")),
    ("Pick a color.", GrammarSpec("ebnf", 'root ::= "The color is " ("red" | "green" | "blue") "."')),
]


def test_constrained_eagle_output_is_identical_to_plain_constrained_output(served_engine):
    prompts = [served_engine.encode(chat(served_engine, q)) for q, _ in IDENTITY]
    params = [SamplingParams(max_new_tokens=64, temperature=0, grammar=g) for _, g in IDENTITY]
    ref = served_engine.generate(prompts, params)
    spec = _spec(num_steps=4, eagle_topk=4, num_draft_tokens=10, cost_table="off", disable_batch_size=0)
    with Engine(EngineConfig(max_total_tokens=8192, spec=spec)) as eng:
        batched = eng.generate(prompts, params)  # the full tree on every step (no budget, no batch limit)
        stats = eng.stats.values
    assert [r.token_ids for r in batched] == [r.token_ids for r in ref]
    assert stats["spec_drafted_steps"] > 0
    assert stats["spec_eagle_accepted_tokens"] < stats["spec_eagle_tokens"]  # drafts were refused
    code = json.loads(ref[2].text)
    jsonschema.validate(code, json.loads(ADVERSARIAL.source))
    assert ref[4].text.startswith("The color is ")


def test_a_grammar_whose_only_token_is_banned_finishes_with_a_dead_end(smol_engine):
    z = smol_engine.encode("Z")
    assert len(z) == 1
    prompt = smol_engine.encode(chat(smol_engine, "Say Z."))
    bias = ((z[0], -100.0),)
    dead, ok = smol_engine.generate(
        [prompt, prompt],
        [
            SamplingParams(
                max_new_tokens=8, temperature=0, grammar=GrammarSpec("ebnf", 'root ::= "Z"'), logit_bias=bias
            ),
            SamplingParams(max_new_tokens=8, temperature=0, grammar=GrammarSpec("ebnf", 'root ::= "Z"')),
        ],
    )
    assert dead.finish_reason == FINISH_DEAD_END and dead.token_ids == []
    assert ok.text == "Z" and ok.finish_reason == "stop"
    assert smol_engine.stats.values["kv_used_tokens"] == 0


def test_logit_bias_bans_and_favours_tokens(smol_engine):
    prompt = smol_engine.encode(chat(smol_engine, "Name a fruit."))
    first = smol_engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0))[0].token_ids[0]
    banned = smol_engine.generate(
        [prompt], SamplingParams(max_new_tokens=1, temperature=0, logit_bias=((first, -100.0),))
    )[0].token_ids[0]
    forced = smol_engine.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0, logit_bias=((42, 100.0),)))[
        0
    ].token_ids
    assert banned != first and forced == [42, 42, 42]


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "strnig"}}}'),
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("ebnf", "root ::= "),
    ],
)
def test_bad_grammars_are_refused_before_rank_0(spec):
    with pytest.raises(InvalidGrammarError) as e:
        check_grammar(spec)
    assert e.value.param == spec.param and str(e.value).startswith(("invalid", "unknown"))


SLOW = GrammarSpec("json_schema", json.dumps(slow_schema()))


def test_a_slow_grammar_is_refused_at_the_limit_while_plain_requests_keep_stepping(smol_dir):
    """Rank 0 compiles grammars in a child process; a compile past `--grammar-compile-timeout` (5 s by default; 1 s
    here) is killed and its request fails with the limit named, while plain requests step meanwhile; the next grammar
    gets a fresh child. (At tp=3 through HTTP: tests/server/test_reliability.py.)"""
    check_grammar(SLOW)  # the front end lets it through
    limit = 1.0
    with Engine(EngineConfig(max_total_tokens=4096, grammar_compile_timeout=limit)) as eng:
        _slow_grammar_is_refused(eng, limit)


def _slow_grammar_is_refused(eng: Engine, limit: float) -> None:
    import queue
    import time

    from runtime.engine import _Sink
    from worker.protocol import ERROR_INVALID_GRAMMAR

    prompt = eng.encode("Tell me a story about a fox.")
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    reference = eng.generate([prompt], greedy)[0].token_ids
    events: queue.SimpleQueue = queue.SimpleQueue()
    reqs = [("slow", prompt, SamplingParams(max_new_tokens=8, grammar=SLOW))]
    reqs += [(f"plain{i}", prompt, greedy) for i in range(2)]
    t0 = time.monotonic()
    eng.submit(reqs, [_Sink(lambda out, rid=rid: events.put((rid, time.monotonic() - t0, out))) for rid, _, _ in reqs])
    finished, tokens, first_token = {}, {"plain0": [], "plain1": []}, {}
    while len(finished) < 3:
        rid, t, out = events.get(timeout=120)
        if out.token_ids:
            first_token.setdefault(rid, t)
            tokens[rid] += out.token_ids
        if out.finish_reason is not None:
            finished[rid] = (t, out)
    t_slow, slow = finished["slow"]
    assert slow.finish_reason == "error" and slow.error_code == ERROR_INVALID_GRAMMAR
    assert f"compiling took longer than the limit of {limit:g} s" in slow.error
    assert limit <= t_slow < limit + 60
    assert all(first_token[r] < t_slow for r in ("plain0", "plain1"))  # they stepped while it compiled
    assert tokens["plain0"] == tokens["plain1"] == reference
    after = eng.generate([prompt], SamplingParams(max_new_tokens=8, grammar=GrammarSpec("json_object")))
    assert after[0].text.startswith("{")
    assert eng.is_alive and eng.stats.values["rank_divergences"] == 0


def test_a_crashing_compile_takes_only_the_child(smol_dir):
    """A native crash in xgrammar (killed here by SIGKILL mid-compile) fails that grammar alone; the next compiles."""
    import functools
    import os
    import signal
    import time

    from worker.model.files import resolve_model
    from worker.model.tokenizer import load_tokenizer
    from worker.sampling.grammar_process import GrammarCompiler

    compiler = GrammarCompiler(functools.partial(load_tokenizer, resolve_model("smollm2-135m-instruct")), 49152, (2,))
    try:
        assert compiler.submit("a", SLOW) is None
        deadline = time.monotonic() + 60
        while compiler._in_flight is None and time.monotonic() < deadline:  # the child starts, then compiles
            assert compiler.poll() == []
            time.sleep(0.05)
        os.kill(compiler.pid, signal.SIGKILL)
        results = []
        while not results and time.monotonic() < deadline:
            results = compiler.poll()
            time.sleep(0.05)
        assert [(r.request_id, r.compiled, r.error) for r in results] == [
            ("a", None, "the grammar compiler crashed on this grammar")
        ]
        assert compiler.submit("b", GrammarSpec("json_object")) is None
        while not (results := compiler.poll()) and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        assert results[0].request_id == "b" and results[0].compiled is not None and compiler.restarts == 1
        assert compiler.submit("c", GrammarSpec("json_object")).compiled is results[0].compiled  # the LRU
    finally:
        compiler.close()
