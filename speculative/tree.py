"""EAGLE-2 dynamic draft trees: expansion bookkeeping, final selection, and attention masks.

Every rank keeps an identical DraftTree per sequence, built only from rank 0's broadcast decisions
(tokens, frontier picks, final selection). Scores exist on rank 0 alone; nothing else depends on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .budget import CONTEXT, EAGLE


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # candidate tokens (target vocabulary)
    parents: list[int] = field(default_factory=list)  # parent candidate, -1 for the root's children
    depths: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # candidates fed to the draft, in feeding order (scratch order)
    frontier: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # rank 0 only: cumulative log-probability (as budget prices it)
    conf: list[float] = field(default_factory=list)  # rank 0 only: the draft's own probability of the token

    def add(self, token: int, parent: int, score: float = 0.0, conf: float = 0.0) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        self.conf.append(conf)
        return len(self.tokens) - 1

    def ancestors_or_self(self, c: int) -> list[int]:
        out = []
        while c >= 0:
            out.append(c)
            c = self.parents[c]
        return out

    def feed_mask(self) -> torch.Tensor:
        """[len(frontier), len(fed)]: which fed candidates (draft scratch KV) each frontier node may see."""
        pos = {c: i for i, c in enumerate(self.fed)}
        rows = [[False] * len(self.fed) for _ in self.frontier]  # filled as lists: a tensor's item writes cost ~1 us
        for row, c in zip(rows, self.frontier):
            for a in self.ancestors_or_self(c):
                row[pos[a]] = True
        return torch.tensor(rows, dtype=torch.bool).view(len(self.frontier), len(self.fed))


def select_candidates(tree: DraftTree, num: int) -> list[int]:
    """Rank 0: the `num` best candidates by cumulative score, ancestors before descendants.

    Scores only fall along a path, so the best set is closed under ancestors; ties go to the lower index,
    which is always the ancestor.
    """
    order = sorted(range(len(tree.tokens)), key=lambda c: (-tree.scores[c], c))[:num]
    return sorted(order)


@dataclass
class VerifyTree:
    """The tree the target verifies: node 0 is the root (the last committed token), then the selection."""

    tokens: list[int]
    parents: list[int]  # node index of each node's parent (-1 for the root)
    depths: list[int]
    sources: list[int] = field(default_factory=list)  # per node: bit 1 EAGLE, bit 2 context (budget.py)
    conf: list[float] = field(default_factory=list)  # rank 0 only: an EAGLE node's draft confidence (else 0)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                kids[parent].append(node)
        return kids

    def mask(self) -> torch.Tensor:
        """[size, size] bool: node i sees node j when j is i or one of its ancestors."""
        n = self.size
        rows = [[False] * n for _ in range(n)]
        for i, row in enumerate(rows):
            j = i
            while j >= 0:
                row[j] = True
                j = self.parents[j]
        return torch.tensor(rows, dtype=torch.bool)


def build_verify_tree(
    root_token: int, tree: DraftTree, selected: list[int], context: list[int], source: int = CONTEXT
) -> VerifyTree:
    """The root, the selected draft candidates, then the chain (from `source`: the context or the corpus) merged in
    where it repeats a drafted path (a shared node is verified once and counts for both sources)."""
    node_of = {c: i + 1 for i, c in enumerate(selected)}
    vt = VerifyTree([root_token], [-1], [0], [0], [0.0])
    for c in selected:
        p = tree.parents[c]
        vt.tokens.append(tree.tokens[c])
        vt.parents.append(0 if p < 0 else node_of[p])
        vt.depths.append(tree.depths[c])
        vt.sources.append(EAGLE)
        vt.conf.append(tree.conf[c])
    node, kids = 0, vt.children()
    for token in context:
        nxt = next((c for c in kids[node] if vt.tokens[c] == token), None)
        if nxt is None:
            vt.tokens.append(token)
            vt.parents.append(node)
            vt.depths.append(vt.depths[node] + 1)
            vt.sources.append(0)
            vt.conf.append(0.0)
            kids.append([])
            nxt = len(vt.tokens) - 1
        vt.sources[nxt] |= source
        node = nxt
    return vt


def draft_only_accepted(vt: VerifyTree, path: list[int]) -> int | None:
    """Accepted nodes on `path` that only the EAGLE draft proposed (what drafting added beside the chain), or None
    where the tree holds no such node (drafting added no row)."""
    if EAGLE not in vt.sources:
        return None
    return sum(1 for node in path if vt.sources[node] == EAGLE)
