"""Tree verification: greedy (longest path matching the target's argmax) and lossless rejection sampling.

Draft tokens are top-k, not sampled, so each candidate is a point mass, accepted with probability p(x) under the
target; a rejected x's mass is removed and p renormalised for the next sibling; the bonus token is drawn from the
rest. `threshold_single` / `threshold_acc` below 1.0 relax this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.sampling.logits import sample_from_probs

from .tree import VerifyTree


def verify_greedy(tree: VerifyTree, node_argmax: Callable[[int, list[int]], int]) -> tuple[list[int], int]:
    """Walk from the root while a child carries the target's argmax. Returns (accepted nodes, bonus token).

    node_argmax(node, path_tokens) gives the target's choice after `node` (path_tokens: accepted so far,
    for penalties)."""
    kids = tree.children()
    node, path, tokens = 0, [], []
    while True:
        want = node_argmax(node, tokens)
        nxt = next((c for c in kids[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        tokens.append(want)
        node = nxt


def verify_sampling(
    tree: VerifyTree,
    node_probs: Callable[[int, list[int]], torch.Tensor],
    generator: torch.Generator,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> tuple[list[int], int]:
    kids = tree.children()
    node, path, tokens = 0, [], []
    while True:
        p = node_probs(node, tokens).clone()
        accepted = None
        for c in kids[node]:
            x = tree.tokens[c]
            px = float(p[x])
            coin = float(torch.rand((), generator=generator, device=p.device))
            if coin < px / threshold_acc or px >= threshold_single:
                accepted = c
                break
            p[x] = 0.0
            total = float(p.sum())
            if total <= 0.0:
                break
            p /= total
        if accepted is None:
            return path, sample_from_probs(p, generator)
        path.append(accepted)
        tokens.append(tree.tokens[accepted])
        node = accepted
