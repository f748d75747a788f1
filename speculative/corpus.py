"""Free drafts from a corpus of the target's own answers (static suffix decoding): where the sequence's last tokens
occur in what the target answered before, the tokens it went on with. A small model answers in set phrases, so its
distilled answers predict where its own context has no match. Rank 0 alone looks up; the chain reaches the other
ranks in the step plan, as a context chain does.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from worker.config import DEFAULT_MODEL, EngineConfig
from worker.model.files import eaglegate_home

log = logging.getLogger(__name__)

MAX_MATCH = 16  # tokens of the sequence's end compared at most
# a chain stops where fewer than this share of the surviving occurrences agree on the next token: on MT-bench, a
# unanimous next token was the target's 53-89% of the time (more with more occurrences), one of a 50-80% majority 20-34%
MIN_SHARE = 0.8
# a match shorter than the key offers its first token where at least half its occurrences agree: on the 80 MT-bench
# answers, where neither the context nor a full-key match had a chain (2,514 of 16,866 positions), such a token was the
# target's 51% of the time after 3 matched tokens, 39% after 2, 26% after 1 (against 37% for the EAGLE head's draft
# there); the budget learns each length's acceptance apart (`leader.chain`)
SHORT_SHARE = 0.5
SHORT_SAMPLE = 1024  # a short match's occurrences voted on at most (a common token occurs 100,000 times)
PAD = -1  # between answers and around the corpus: never equal to a token, so no match or chain crosses it
# the default model's self-distilled answers, written by `eaglegate distill` (training/distill.py) on a CPU and by its
# batched runner on a GPU (dense bfloat16 weights, so kept apart with their own MANIFEST.json)
DISTILLED = Path(__file__).resolve().parent / "answers" / "distilled"
DISTILLED_GPU = Path(__file__).resolve().parent / "answers" / "distilled-gpu"
DISTILLED_ANSWERS = (DISTILLED, DISTILLED_GPU)


def answer_shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("answers-*.jsonl.gz"))


def answer_records(shards: Iterable[Path]) -> Iterator[dict]:
    """The records of distilled-answer shards in order: {"i": conversation, "ids": answer token ids[, "turn": t]}."""
    for shard in shards:
        with gzip.open(shard, "rt") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def read_answers(folder: Path = DISTILLED, turn: int = 1) -> dict[int, list[int]]:
    """Every committed answer to a conversation's turn-th human message, by conversation index (records without a
    "turn" field answer the first)."""
    return {rec["i"]: rec["ids"] for rec in answer_records(answer_shards(folder)) if rec.get("turn", 1) == turn}


def read_all_answers(turn: int = 1) -> dict[int, list[int]]:
    """The CPU engine's answers, and the GPU's for the conversations the CPU has not answered."""
    return read_answers(DISTILLED_GPU, turn) | read_answers(DISTILLED, turn)


class Corpus:
    """The answers' key_len-token windows, sorted by a packed uint64 key, with their end positions. A lookup takes
    the longest suffix that occurs (key_len tokens, else fewer), extends it backward while occurrences survive, then
    follows them forward one majority token at a time."""

    def __init__(self, answers: Iterable[list[int]]):
        parts = [np.full(MAX_MATCH, PAD, dtype=np.int32)]
        for ids in answers:
            parts += [np.asarray(ids, dtype=np.int32), np.full(1, PAD, dtype=np.int32)]
        parts.append(np.full(MAX_MATCH, PAD, dtype=np.int32))
        self.tokens = np.concatenate(parts)
        top = int(self.tokens.max(initial=0))
        self.bits = max(16, top.bit_length())
        self.key_len = 64 // self.bits  # 4 tokens below 65,536 ids, 3 below 2**21
        # newest token in the highest bits, so the windows ending in any shorter suffix form one sorted range: with
        # 16-bit ids (key_len 4) the window a b c d has key d<<48 | c<<32 | b<<16 | a, and the windows ending in
        # "c d" are the keys in [(d<<16 | c) << 32, ((d<<16 | c) + 1) << 32)   (`_range`)
        t = self.tokens.astype(np.uint64)
        ends = np.arange(self.key_len - 1 + MAX_MATCH, len(t) - 1)
        keys = np.zeros(len(ends), dtype=np.uint64)
        valid = np.ones(len(ends), dtype=bool)
        for i in range(self.key_len):  # i = 0, the newest token, ends up in the highest bits
            valid &= self.tokens[ends - i] >= 0
            keys = (keys << np.uint64(self.bits)) | t[ends - i]
        valid &= self.tokens[ends + 1] >= 0  # a window must be followed by a token
        order = np.argsort(keys[valid], kind="stable")
        self.keys = keys[valid][order]
        self.ends = ends[valid][order].astype(np.int64)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")  # engines starting together each write their own
        np.savez(tmp, tokens=self.tokens, keys=self.keys, ends=self.ends, bits=self.bits, key_len=self.key_len)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Corpus:
        corpus = cls.__new__(cls)
        with np.load(path) as a:
            corpus.tokens, corpus.keys, corpus.ends = a["tokens"], a["keys"], a["ends"]
            corpus.bits, corpus.key_len = int(a["bits"]), int(a["key_len"])
        return corpus

    @property
    def num_tokens(self) -> int:
        return int((self.tokens >= 0).sum())

    def _range(self, suffix: list[int]) -> tuple[int, int]:
        """The index range of the windows that end in `suffix` (at most key_len tokens)."""
        key = 0
        for tok in reversed(suffix):
            key = (key << self.bits) | tok
        shift = self.bits * (self.key_len - len(suffix))
        lo = np.searchsorted(self.keys, np.uint64(key << shift), "left")
        return int(lo), int(np.searchsorted(self.keys, np.uint64(((key + 1) << shift) - 1), "right"))

    def draft(self, tokens: list[int], max_tokens: int) -> tuple[list[int], int, int]:
        """(continuation, support, match): up to `max_tokens` majority tokens after the occurrences of the longest
        suffix of `tokens` in the corpus, how many occurrences agree on its first token, and the suffix's length (up
        to MAX_MATCH); ([], 0, 0) when none occurs. Shorter-than-key suffixes use SHORT_SHARE for the first token."""
        k = self.key_len
        if max_tokens < 1:
            return [], 0, 0
        indexed = 0  # the suffix's tokens the index can hold (a larger vocabulary than the corpus's ids)
        while indexed < min(k, len(tokens)) and tokens[-1 - indexed] < 1 << self.bits:
            indexed += 1
        for m in range(indexed, 0, -1):  # the longest suffix of at most the key's length that occurs
            lo, hi = self._range(tokens[-m:])
            if lo < hi:
                break
        else:
            return [], 0, 0
        ends = self.ends[lo:hi]
        if m == k:
            for d in range(k, min(MAX_MATCH, len(tokens))):  # the longest suffix that still occurs
                keep = ends[self.tokens[ends - d] == tokens[-1 - d]]
                if keep.size == 0:
                    break
                ends, m = keep, d + 1
        elif len(ends) > SHORT_SAMPLE:  # evenly over the range: the windows sorted by their older tokens
            ends = ends[np.linspace(0, len(ends) - 1, SHORT_SAMPLE).astype(np.int64)]
        chain: list[int] = []
        support = 0
        while len(chain) < max_tokens:
            nxt = self.tokens[ends + 1]
            tok, count = _majority(nxt)
            share = SHORT_SHARE if m < k and not chain else MIN_SHARE
            if tok < 0 or count < share * len(nxt):
                break
            chain.append(tok)
            ends = ends[nxt == tok] + 1
            support = support or len(ends)
        return chain, support, m


def _majority(tokens: np.ndarray) -> tuple[int, int]:
    """The most frequent token (the smallest of those tied) and its count. Most lookups vote among a few occurrences,
    where counting in Python beats np.unique's sort (about 20 us a call, several calls a step)."""
    if len(tokens) > 64:
        vals, counts = np.unique(tokens, return_counts=True)
        best = int(counts.argmax())
        return int(vals[best]), int(counts[best])
    counts: dict[int, int] = {}
    for t in tokens.tolist():
        counts[t] = counts.get(t, 0) + 1
    return min(counts.items(), key=lambda tc: (-tc[1], tc[0]))


def corpus_folders(config: EngineConfig) -> list[Path]:
    """Where --speculative-corpus points: the default model's distilled answers (auto), a folder, or nothing."""
    choice = config.spec.corpus
    if choice == "off":
        return []
    if choice == "auto":  # the committed answers are the default model's own
        return list(DISTILLED_ANSWERS) if config.model_path == DEFAULT_MODEL else []
    return [Path(choice)]


def load_corpus(config: EngineConfig) -> Corpus | None:
    """Rank 0's corpus: built from every answer (any turn) in the folders' answers-*.jsonl.gz shards, cached by their
    contents under EAGLEGATE_HOME (a build reads 3.1M tokens of JSON: about 2 s; the cache about 0.05 s)."""
    shards = [p for folder in corpus_folders(config) for p in answer_shards(folder)]
    if not shards:
        if config.spec.corpus not in ("auto", "off"):
            raise ValueError(f"--speculative-corpus {config.spec.corpus}: no answers-*.jsonl.gz there")
        return None
    digest = hashlib.sha256(f"corpus v2 {MAX_MATCH}".encode())  # v2: newest token first
    for p in shards:
        digest.update(p.read_bytes())
    cached = eaglegate_home() / "corpus" / f"{digest.hexdigest()[:20]}.npz"
    if cached.exists():
        return Corpus.load(cached)
    corpus = Corpus(rec["ids"] for rec in answer_records(shards))
    try:
        corpus.save(cached)
    except OSError as e:  # a read-only home still serves, rebuilding each start
        log.warning("corpus cache not written: %s", e)
    return corpus
