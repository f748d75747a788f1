"""Grammars over the size, nesting or repeat limits are refused by name before anything parses or compiles them."""

from __future__ import annotations

import pytest

from devtools.schemas import nested_schema
from worker.sampling import grammar
from worker.sampling.grammar import MAX_GRAMMAR_CHARS, MAX_REPEAT, MAX_SCHEMA_NESTING, check_grammar, json_nesting
from worker.sampling.params import GrammarSpec, InvalidGrammarError


def test_nesting_is_counted_without_parsing_and_ignores_strings():
    assert json_nesting(nested_schema(3)) == 7
    assert json_nesting('{"a": "{{[[", "b": "\\"{"}') == 1
    assert json_nesting("[" * 100_000) == 100_000  # no recursion to run out of


@pytest.mark.parametrize(
    "spec,limit",
    [
        (GrammarSpec("json_schema", nested_schema(250)), f"limit of {MAX_SCHEMA_NESTING} levels"),
        (GrammarSpec("json_schema", nested_schema(400)), f"limit of {MAX_SCHEMA_NESTING} levels"),
        (GrammarSpec("regex", "[a-z]{1,5000}"), f"limit of {MAX_REPEAT}"),
        (GrammarSpec("ebnf", 'root ::= "a"{300}'), f"limit of {MAX_REPEAT}"),
        (GrammarSpec("regex", "((a{20}){20}){20}"), f"limit of {MAX_REPEAT}"),  # 8,000 expansions, 20 at a time
        (GrammarSpec("regex", "a{,9999}"), f"limit of {MAX_REPEAT}"),
        (GrammarSpec("regex", r"\\{9999}"), f"limit of {MAX_REPEAT}"),  # an escaped backslash, then a real repeat
        (GrammarSpec("json_schema", '{"type": "string", "pattern": "[a-z]{1,5000}"}'), f"limit of {MAX_REPEAT}"),
        (GrammarSpec("regex", "a" * (MAX_GRAMMAR_CHARS + 1)), f"limit of {MAX_GRAMMAR_CHARS} characters"),
    ],
    ids=[
        "schema-250",
        "schema-400",
        "regex-repeat",
        "ebnf-repeat",
        "nested",
        "open-lower",
        "escape",
        "pattern",
        "size",
    ],
)
def test_a_grammar_over_a_limit_is_refused_by_name_before_any_parser_sees_it(spec, limit, monkeypatch):
    def parse(_):
        raise AssertionError("a grammar over a limit reached the parser")

    monkeypatch.setattr(grammar, "build_grammar", parse)
    with pytest.raises(InvalidGrammarError) as e:
        check_grammar(spec)
    assert limit in str(e.value) and e.value.param == spec.param


def test_grammars_within_the_limits_still_compile():
    check_grammar(GrammarSpec("json_schema", nested_schema(20)))
    check_grammar(GrammarSpec("regex", "[a-z]{1,200}"))
    check_grammar(GrammarSpec("regex", r"a\{1,999\}"))  # an escaped brace is a literal, not a repeat
    check_grammar(GrammarSpec("ebnf", 'root ::= "{300}"'))  # so is a brace inside an EBNF string
    check_grammar(GrammarSpec("json_schema", '{"type": "string", "maxLength": 100000}'))  # a counter, not a repeat
