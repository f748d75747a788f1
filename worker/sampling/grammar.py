"""Grammar-constrained decoding on rank 0 (xgrammar): JSON, JSON Schema, regex and EBNF.

Only rank 0 holds grammar state. It masks a row's logits to what the grammar allows before choosing a token, and
verification walks the tree with the matcher, so output is that of plain constrained decoding. JSON is generated
compact, which keeps a small model from filling its budget with blank lines.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from worker.sampling.params import KINDS, GrammarSpec, InvalidGrammarError

# Limits checked before anything compiles: compile time grows with a schema's nesting and a regex's bounded repeats
# (a schema nested 300 levels takes xgrammar 10 s, `[a-z]{1,200}` 0.45 s, `a{1,5000}` 1.6 s), and rank 0 compiles
# for every rank.
MAX_GRAMMAR_CHARS = 65536
MAX_SCHEMA_NESTING = 128  # objects and arrays inside each other in the schema JSON (two a level of properties)
MAX_REPEAT = 256  # the largest expansion of {m,n} repeats, counts multiplied where one repeat holds another
_COUNTS = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def json_nesting(text: str) -> int:
    """The deepest nesting of objects and arrays in a JSON text, counted without parsing it (parsing recurses)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
    return deepest


def repeat_expansion(source: str, quoted: bool = False) -> int:
    """How many times the most repeated atom of a regex or an EBNF grammar can expand: each {m,n} multiplies what it
    repeats, so `(a{4}){3}` is 12. Escapes and character classes hold no repeats; with `quoted`, neither do "..."
    and '...' strings (EBNF literals)."""
    stack = [1]  # per open group: the largest expansion inside it so far
    last = 1  # the expansion of the atom just read, which a following {m,n} multiplies
    i = 0
    while i < len(source):
        ch = source[i]
        if ch == "\\":
            i, last = i + 2, 1
            continue
        if ch == "[" or (quoted and ch in "\"'"):
            close = "]" if ch == "[" else ch
            i += 1
            while i < len(source) and source[i] != close:
                i += 2 if source[i] == "\\" else 1
            last = 1
        elif ch == "(":
            stack.append(1)
        elif ch == ")" and len(stack) > 1:
            last = stack.pop()
        elif ch == "{" and (m := _COUNTS.match(source, i)) and any(m.groups()):
            last *= max(int(n) for n in m.groups() if n)
            stack[-1] = max(stack[-1], last)
            i = m.end()
            continue
        else:
            last = 1
        i += 1
    return max(stack)


def _schema_patterns(text: str) -> list[str]:
    """Every "pattern" string of a JSON schema (parsed only after its nesting passed the limit)."""
    found, todo = [], [json.loads(text)]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return found


def check_limits(spec: GrammarSpec) -> None:
    """A grammar over the size, nesting or repeat limits is refused by name, before any parser sees it."""
    if len(spec.source) > MAX_GRAMMAR_CHARS:
        raise InvalidGrammarError(spec.param, f"{spec.kind} is longer than the limit of {MAX_GRAMMAR_CHARS} characters")
    if spec.kind == "json_schema" and json_nesting(spec.source) > MAX_SCHEMA_NESTING:
        raise InvalidGrammarError(spec.param, f"JSON schema nests deeper than the limit of {MAX_SCHEMA_NESTING} levels")
    if spec.kind == "json_schema":
        try:
            expansions = [repeat_expansion(p) for p in _schema_patterns(spec.source)]
        except ValueError:  # not JSON: the schema check says so
            expansions = []
    elif spec.kind in ("regex", "ebnf"):
        expansions = [repeat_expansion(spec.source, quoted=spec.kind == "ebnf")]
    else:
        expansions = []
    if expansions and max(expansions) > MAX_REPEAT:
        raise InvalidGrammarError(
            spec.param, f"{spec.kind} repeats expand to {max(expansions)}, over the limit of {MAX_REPEAT} for {{m,n}}"
        )


def check_grammar(spec: GrammarSpec) -> None:
    """Parse without a tokenizer (fast), so a bad grammar is a 400 before the request reaches rank 0."""
    if spec.kind not in KINDS:
        raise InvalidGrammarError(spec.param, f"unknown grammar kind {spec.kind!r}; use one of {', '.join(KINDS)}")
    check_limits(spec)
    if spec.kind == "json_schema":
        _check_schema(spec)
    try:
        build_grammar(spec)
    except Exception as e:  # xgrammar raises RuntimeError with the parser's message
        raise InvalidGrammarError(spec.param, f"invalid {spec.kind}: {_first_line(e)}") from e


def _check_schema(spec: GrammarSpec) -> None:
    import jsonschema

    try:
        schema = json.loads(spec.source)
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except (ValueError, jsonschema.SchemaError) as e:
        msg = e.message if isinstance(e, jsonschema.SchemaError) else str(e)
        raise InvalidGrammarError(spec.param, f"invalid JSON schema: {msg}") from e


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^(\[[^\]]*\]\s*)?\S+\.cc:\d+:\s*", "", text)  # drop xgrammar's "[time] file.cc:line:" prefix


def build_grammar(spec: GrammarSpec):
    import xgrammar as xgr

    if spec.kind == "json_object":  # any object, compact
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec.source, any_whitespace=False)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.source)
    return xgr.Grammar.from_ebnf(spec.source)


def matcher(compiled, vocab_size: int) -> Matcher:
    """A fresh grammar state for one sequence over a compiled grammar (worker/sampling/grammar_process.py)."""
    import xgrammar as xgr

    return Matcher(xgr.GrammarMatcher(compiled), vocab_size)


@dataclass
class Matcher:
    """One sequence's grammar state on rank 0, plus how far a verify walk has advanced it past the commit."""

    inner: object  # xgrammar.GrammarMatcher
    vocab_size: int
    _walked: int = 0  # path tokens a verify walk has fed
    _rollback: int = 0  # of those, accepted (what end_speculation undoes)
    _bitmask: torch.Tensor | None = None

    def mask_(self, row: torch.Tensor) -> None:
        """In place on a float32 row the caller owns: every token the grammar forbids at -inf (all at a dead end).

        Past the end (a verify walk that accepted the stop token) nothing more is committed: the row is left."""
        import xgrammar as xgr

        if self.terminated:
            return
        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.inner.fill_next_token_bitmask(self._bitmask)
        xgr.apply_token_bitmask_inplace(row.unsqueeze(0), self._bitmask, vocab_size=self.vocab_size)

    def accept(self, token: int) -> bool:
        return bool(self.inner.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self.inner.is_terminated())

    def speculate(self, path_tokens: list[int]) -> None:
        """Bring the matcher to committed + path_tokens (a verify walk only ever extends its path)."""
        for tok in path_tokens[self._walked :]:
            self._rollback += int(self.accept(tok))
        self._walked = max(self._walked, len(path_tokens))

    def end_speculation(self) -> None:
        if self._rollback:
            self.inner.rollback(self._rollback)
        self._walked = self._rollback = 0
