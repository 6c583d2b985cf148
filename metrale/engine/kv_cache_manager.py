"""Paged KV blocks: a fixed pool, reference counts, one block table per request, and the
automatic prefix cache.

No torch here: the pool hands out block ids; the model runner owns the tensors they index.

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


class KVCacheManager:
    """Block tables per request, growing as the request's computed tokens grow."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # the request's full-block hashes so far
        self._num_cached: dict[str, int] = {}  # leading blocks of the table already registered
        self.prefix_queries_total = 0  # tokens looked up in the prefix cache
        self.prefix_hits_total = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- the prefix cache ----------------------------------------------------------------------

    def _full_block_hashes(self, request_id: str, token_ids: list[int], extra_keys: tuple,
                           num_tokens: int | None = None) -> list[bytes]:
        """Hashes of the full blocks among the first `num_tokens` (default: all) of `token_ids`."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        limit = len(token_ids) if num_tokens is None else num_tokens
        while (len(hashes) + 1) * bs <= limit:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs], extra_keys))
        return hashes

    def find_cached_prefix(self, request_id: str, token_ids: list[int], extra_keys: tuple = ()) -> list[int]:
        """Blocks holding the longest cached prefix of `token_ids` (no references taken)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self._full_block_hashes(request_id, token_ids, extra_keys):
            block = self.pool.cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int,
                          extra_keys: tuple = ()) -> None:
        """Register the request's blocks that are full and computed, for later requests.
        `num_computed_tokens` must not reach past tokens whose values are known."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request_id, [])
        done = self._num_cached.get(request_id, 0)
        full = min(num_computed_tokens // self.block_size, len(table))
        if full <= done:
            return
        hashes = self._full_block_hashes(request_id, token_ids, extra_keys, num_computed_tokens)
        for i in range(done, full):
            self.pool.register(table[i], hashes[i])
        self._num_cached[request_id] = full

    # -- tables --------------------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       prefix_blocks: list[int] | None = None) -> list[int] | None:
        """Grow the request's table to hold `num_total_tokens` tokens, starting it with the
        cached `prefix_blocks` if given (a new request's prefix hit).

        Returns the newly added block ids, or None (and changes nothing) when the pool is short.
        """
        table = self.block_tables.get(request_id, [])
        if not prefix_blocks and num_total_tokens <= len(table) * self.block_size:
            return []  # the common decode step: the last block still has room
        prefix_blocks = prefix_blocks or []
        missing = self.blocks_needed(num_total_tokens) - len(table) - len(prefix_blocks)
        # Hit blocks that are free now stop being free once referenced.
        reclaimed = sum(1 for b in prefix_blocks if self.pool.ref_count(b) == 0)
        if max(missing, 0) > self.pool.num_free_blocks - reclaimed:
            return None
        self.pool.touch(prefix_blocks)
        new_blocks = self.pool.allocate(max(missing, 0))
        table = self.block_tables.setdefault(request_id, [])
        table.extend(prefix_blocks)
        table.extend(new_blocks)
        if prefix_blocks:
            self._num_cached[request_id] = len(prefix_blocks)
        return prefix_blocks + new_blocks

    def free(self, request_id: str, forget_hashes: bool = True) -> None:
        table = self.block_tables.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if forget_hashes:
            self._hashes.pop(request_id, None)
        if table:
            # Released in reverse: a prefix's tail blocks are evicted before its head, which
            # more requests are likely to share.
            self.pool.release(list(reversed(table)))

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])
