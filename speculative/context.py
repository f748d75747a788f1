"""Free drafts from the context (prompt lookup): the tokens that followed the most recent earlier occurrence of
the sequence's last n tokens. They cost no draft forward and pay on summarising, editing, quoting and code.

Rank 0 alone looks them up; the candidates travel to the other ranks in the step plan.
"""

from __future__ import annotations

import numpy as np


def context_draft(tokens: list[int], max_ngram: int, max_tokens: int) -> tuple[list[int], int]:
    """(continuation, n): up to `max_tokens` tokens after an earlier match of the longest suffix n-gram (n from
    `max_ngram` down to 1), the latest match that has `max_tokens` tokens after it, else the earliest;
    ([], 0) when the last token never occurred before."""
    if max_tokens < 1 or len(tokens) < 2:
        return [], 0
    arr = np.asarray(tokens, dtype=np.int64)
    last = len(arr) - 1
    # positions i < last where arr[i] == arr[last]: candidate ends of an earlier occurrence
    ends = np.flatnonzero(arr[:last] == arr[last])
    if ends.size == 0:
        return [], 0
    end, best_n = int(ends[0]), 1
    for n in range(1, max_ngram + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[arr[ends - (n - 1)] == arr[last - (n - 1)]]
            if ends.size == 0:
                break
        # the latest match with a full continuation; in periodic text the latest overlaps the end, so go earlier
        full = ends[ends <= last - max_tokens]
        end, best_n = (int(full[-1]) if full.size else int(ends[0])), n
    return arr[end + 1 : end + 1 + max_tokens].tolist(), best_n
