"""Rank 0's prefix cache: a radix tree over full KV blocks (SGLang's RadixAttention, page-granular).

A node is one block whose target KV, EAGLE features and (where marked) draft KV are valid for the prefix on its
path. Sequences pin the nodes they use; unpinned leaves are evicted least recently used. Followers keep no tree:
a hit changes a block table, which reaches them in the step plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from itertools import count


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    block: int
    parent: Node | None
    draft_ok: bool = False  # the draft's KV for every position of this block is valid
    refs: int = 0
    last_used: int = 0
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)


@dataclass
class CacheStats:
    hit_tokens: int = 0  # prompt tokens served from the cache
    prompt_tokens: int = 0  # prompt tokens admitted (hit or not)
    evicted_blocks: int = 0
    cached_blocks: int = 0


class PrefixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.root = Node((), -1, None)
        self.clock = count(1)
        self.stats = CacheStats()
        self.pinned = 0  # nodes some sequence holds; chains start at the root, so their ancestors are held too

    def _key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def match(self, tokens: list[int]) -> list[Node]:
        """The blocks a new sequence shares: the longest cached chain prefixing `tokens` (leaving a token to
        compute), less its last block, which is recomputed because the draft's KV at its last position depends on
        the next token. Plain engines recompute it too, so both split a prompt alike (bfloat16 rounds a short tail
        differently from a long one)."""
        node, chain = self.root, []
        for i in range((len(tokens) - 1) // self.block_size):
            node = node.children.get(self._key(tokens, i))
            if node is None:
                break
            chain.append(node)
        return chain[:-1]

    def pin(self, chain: list[Node]) -> None:
        now = next(self.clock)
        for node in chain:
            self.pinned += node.refs == 0
            node.refs += 1
            node.last_used = now

    def unpin(self, chain: list[Node]) -> None:
        now = next(self.clock)
        for node in chain:
            assert node.refs > 0, "unpinning a block no sequence holds"
            node.refs -= 1
            self.pinned -= node.refs == 0
            node.last_used = now

    def insert(
        self, tokens: list[int], blocks: list[int], chain: list[Node], num_valid: int, draft_valid: int
    ) -> list[tuple[int, Node]]:
        """Extend `chain` (pinned, covering blocks[:len(chain)]) with the sequence's further full blocks, pinning
        each node it joins; new blocks become nodes the tree owns. A block another sequence cached meanwhile (same
        prefix prefilled at once) is returned as (index, node): the caller swaps in the node's block."""
        duplicates = []
        parent = chain[-1] if chain else self.root
        now = next(self.clock)
        for i in range(len(chain), num_valid // self.block_size):
            key = self._key(tokens, i)
            node = parent.children.get(key)
            if node is None:
                node = Node(key, blocks[i], parent, draft_valid >= (i + 1) * self.block_size)
                parent.children[key] = node
                self.stats.cached_blocks += 1
            else:
                duplicates.append((i, node))
            self.pin([node])
            node.last_used = now
            chain.append(node)
            parent = node
        return duplicates

    def mark_draft(self, chain: list[Node], draft_valid: int) -> None:
        for i, node in enumerate(chain):
            node.draft_ok = node.draft_ok or draft_valid >= (i + 1) * self.block_size

    def evict(self, want: int) -> list[int]:
        """Free up to `want` blocks: unpinned leaves, least recently used first (parents become leaves)."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n.refs == 0]
        heapq.heapify(leaves)
        freed: list[int] = []
        while leaves and len(freed) < want:
            node = heapq.heappop(leaves)[2]
            del node.parent.children[node.key]
            freed.append(node.block)
            parent = node.parent
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        self.stats.evicted_blocks += len(freed)
        self.stats.cached_blocks -= len(freed)
        return freed

    def evictable(self) -> int:
        """Blocks eviction could free now: every node no sequence holds."""
        return self.stats.cached_blocks - self.pinned

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def blocks(self) -> set[int]:
        return {n.block for n in self._nodes()}
