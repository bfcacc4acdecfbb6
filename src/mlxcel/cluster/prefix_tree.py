"""An approximate prefix tree per replica over request text (spec X routing).

A trie whose nodes are fixed-size blocks of text, each named by a chain hash of every block
up to it (as the KV cache names token blocks): matching walks the leading blocks of a text
while their hashes are known. Bounded by an LRU over nodes, so it forgets what the replica's
own prefix cache has most likely evicted too. Pure Python, no Ray.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator

BLOCK_CHARS = 64  # text per trie node: a few dozen tokens, the KV cache's block granularity in text
MAX_PREFIX_CHARS = 64 * 1024  # only a prompt's head matters for routing; bounds the work per request


def _block_hashes(text: str, block_chars: int) -> Iterator[bytes]:
    """Chain hashes of the full blocks of `text[:MAX_PREFIX_CHARS]`, first block first."""
    head = text[:MAX_PREFIX_CHARS]
    parent = b""
    for start in range(0, len(head) - block_chars + 1, block_chars):
        parent = hashlib.blake2b(parent + head[start:start + block_chars].encode("utf-8", "surrogatepass"),
                                 digest_size=16).digest()
        yield parent


class PrefixTree:
    """The text prefixes one replica has seen, as trie nodes of `block_chars` characters."""

    def __init__(self, max_nodes: int = 65536, block_chars: int = BLOCK_CHARS) -> None:
        if max_nodes < 1 or block_chars < 1:
            raise ValueError("max_nodes and block_chars must be at least 1")
        self.max_nodes = max_nodes
        self.block_chars = block_chars
        self._nodes: OrderedDict[bytes, None] = OrderedDict()  # LRU order: oldest first

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def match_len(self, text: str) -> int:
        """Characters of `text`'s head this tree holds (a multiple of `block_chars`); refreshes them."""
        matched: list[bytes] = []
        for node in _block_hashes(text, self.block_chars):
            if node not in self._nodes:
                break
            matched.append(node)
        self._refresh(matched)
        return len(matched) * self.block_chars

    def insert(self, text: str) -> None:
        """Remember every full block of `text`'s head, evicting the least recently used nodes."""
        self._refresh(list(_block_hashes(text, self.block_chars)))
        while len(self._nodes) > self.max_nodes:
            self._nodes.popitem(last=False)

    def _refresh(self, path: list[bytes]) -> None:
        # Deepest node first, so a path's root is the newest: LRU then drops leaves before roots.
        for node in reversed(path):
            self._nodes[node] = None
            self._nodes.move_to_end(node)

    def clear(self) -> None:
        self._nodes.clear()
