"""Free drafts from a corpus of the target's own answers (static suffix decoding): where the sequence's last tokens
occurred in what the target answered before, the tokens it went on with. A small model answers in set phrases
(list openings, closing courtesies, markdown), so its distilled answers predict where its own context has no match.

The index maps every KEY-token window of the corpus, packed exactly into one uint64, to the windows' end positions,
sorted; a lookup finds the windows equal to the sequence's last KEY tokens, extends the match backward while any
survive, then follows the surviving occurrences forward, one majority token at a time. Rank 0 alone looks up; the
chain reaches the other ranks in the step plan, as a context chain does.
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
from worker.model_files import eaglegate_home

log = logging.getLogger(__name__)

MAX_MATCH = 16  # tokens of the sequence's end compared at most
# a chain stops where fewer than this share of the surviving occurrences agree on the next token: on MT-bench, a
# unanimous next token was the target's 53-89% of the time (more with more occurrences), one of a 50-80% majority 20-34%
MIN_SHARE = 0.8
PAD = -1  # between answers and around the corpus: never equal to a token, so no match or chain crosses it
# the default model's self-distilled answers, committed by training/distill.py (CPU) and its GPU runner; read as
# files, so serving does not import the training package
_ROOT = Path(__file__).resolve().parent.parent
DISTILLED_ANSWERS = (_ROOT / "training" / "distilled", _ROOT / "training" / "distilled-gpu")


def answer_shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("answers-*.jsonl.gz"))


def answer_records(shards: Iterable[Path]) -> Iterator[dict]:
    """The records of distilled-answer shards in order: {"i": conversation, "ids": answer token ids[, "turn": t]}."""
    for shard in shards:
        with gzip.open(shard, "rt") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


class Corpus:
    def __init__(self, answers: Iterable[list[int]]):
        parts = [np.full(MAX_MATCH, PAD, dtype=np.int32)]
        for ids in answers:
            parts += [np.asarray(ids, dtype=np.int32), np.full(1, PAD, dtype=np.int32)]
        parts.append(np.full(MAX_MATCH, PAD, dtype=np.int32))
        self.tokens = np.concatenate(parts)
        top = int(self.tokens.max(initial=0))
        self.bits = max(16, top.bit_length())
        self.key_len = 64 // self.bits  # 4 tokens below 65,536 ids, 3 below 2**21
        t = self.tokens.astype(np.uint64)
        ends = np.arange(self.key_len - 1 + MAX_MATCH, len(t) - 1)
        keys = np.zeros(len(ends), dtype=np.uint64)
        valid = np.ones(len(ends), dtype=bool)
        for i in range(self.key_len):  # oldest token in the highest bits
            col = self.tokens[ends - (self.key_len - 1 - i)]
            valid &= col >= 0
            keys = (keys << np.uint64(self.bits)) | t[ends - (self.key_len - 1 - i)]
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

    def _pack(self, window: list[int]) -> np.uint64:
        key = 0
        for tok in window:
            key = (key << self.bits) | tok
        return np.uint64(key)

    def draft(self, tokens: list[int], max_tokens: int) -> tuple[list[int], int]:
        """(continuation, support): up to `max_tokens` majority tokens after the occurrences of the longest suffix of
        `tokens` (at least the key length) found in the corpus, and how many occurrences agree on its first token;
        ([], 0) when there is none."""
        k = self.key_len
        if max_tokens < 1 or len(tokens) < k or max(tokens[-k:]) >= 1 << self.bits:
            return [], 0
        key = self._pack(tokens[-k:])
        lo, hi = np.searchsorted(self.keys, key, "left"), np.searchsorted(self.keys, key, "right")
        if lo == hi:
            return [], 0
        ends = self.ends[lo:hi]
        for d in range(k, min(MAX_MATCH, len(tokens))):  # the longest suffix that still occurs
            keep = ends[self.tokens[ends - d] == tokens[-1 - d]]
            if keep.size == 0:
                break
            ends = keep
        chain: list[int] = []
        support = 0
        while len(chain) < max_tokens:
            nxt = self.tokens[ends + 1]
            vals, counts = np.unique(nxt, return_counts=True)
            best = int(counts.argmax())
            tok = int(vals[best])
            if tok < 0 or counts[best] < MIN_SHARE * len(nxt):
                break
            chain.append(tok)
            ends = ends[nxt == tok] + 1
            support = support or len(ends)
        return chain, support


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
    digest = hashlib.sha256(f"corpus v1 {MAX_MATCH}".encode())
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
