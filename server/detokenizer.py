"""Incremental detokenization: never emits half a UTF-8 character, never emits any part of a stop string.

Special tokens are left out of the text, except those in `keep`: an output parser's tags, which some tokenizers mark
special (a GLM or DeepSeek tool-call tag would otherwise vanish before the parser sees it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    stop: list[str] = field(default_factory=list)
    keep: frozenset[int] = frozenset()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # all text decoded so far (up to the last complete character)
    emitted: int = 0  # characters of `text` already handed out
    prefix_offset: int = 0
    read_offset: int = 0
    stopped: bool = False

    def __post_init__(self):
        self._skip = special_token_ids(self.tokenizer) - self.keep if self.keep else None

    def _decode(self, ids: list[int]) -> str:
        if self._skip is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        ids = [i for i in ids if i not in self._skip]
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add(self, new_ids: list[int]) -> str:
        """Feed tokens; returns the text that is now safe to emit (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """At the end of generation: whatever was held back for a possible stop string is safe now."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i != -1]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        limit = len(self.text) if final else len(self.text) - self._held_back()
        out = self.text[self.emitted : max(limit, self.emitted)]
        self.emitted += len(out)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best


def special_token_ids(tokenizer) -> frozenset[int]:
    """Every token `skip_special_tokens` leaves out: the named special tokens and the added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def kept_token_ids(tokenizer, markers: tuple[str, ...]) -> frozenset[int]:
    """The ids of `markers` that the tokenizer has as special tokens of their own (the detokenizer keeps them)."""
    if not markers:
        return frozenset()
    vocab = tokenizer.get_added_vocab()
    special = special_token_ids(tokenizer)
    return frozenset(vocab[m] for m in markers if m in vocab and vocab[m] in special)
