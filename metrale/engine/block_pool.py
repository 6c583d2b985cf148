"""The pool of paged cache blocks: reference counts, LRU reuse of freed blocks, and the content
hashes of the prefix cache.

No torch here: the pool hands out block ids; the model runner owns the tensors they index (every
paged cache of every layer, under one block table).

Invariants:
- A block's ref count is the number of block tables holding it. Blocks with ref count 0 sit in
  the free queue, least recently used first, and `num_free_blocks` counts exactly them.
- A full block may carry a content hash (prefix cache). A free block keeps its hash, so a later
  request with the same prefix can take it back, until the block is handed out again (evicted).
- Hashes chain: SHA-256 over (parent hash, the block's token ids, extra keys such as an adapter
  or media hash). Two blocks share KV only if their whole prefixes are equal, and a planned
  collision would need a SHA-256 collision.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict


def block_hash(parent: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        h.update(b"\x1f" + str(key).encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_count = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the front of the free queue, evicting their cached content."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks with {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of.pop(block, None)
            if old is not None:
                del self._block_of[old]
            self._ref_count[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit)."""
        for block in blocks:
            if self._ref_count[block] == 0:
                del self._free[block]
            self._ref_count[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._ref_count[block] -= 1
            assert self._ref_count[block] >= 0, f"block {block} released more often than taken"
            if self._ref_count[block] == 0:
                self._free[block] = None  # most recently used: evicted last

    def cached_block(self, content_hash: bytes) -> int | None:
        return self._block_of.get(content_hash)

    def register(self, block: int, content_hash: bytes) -> None:
        if block in self._hash_of or content_hash in self._block_of:
            return  # already cached, or the same content sits in another block
        self._hash_of[block] = content_hash
        self._block_of[content_hash] = block
