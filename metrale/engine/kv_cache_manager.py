"""Paged KV blocks: a fixed pool, reference counts, and one block table per request.

No torch here: the pool hands out block ids; the model runner owns the tensors they index.
Invariant: a block is either in `_free` (ref count 0) or referenced by at least one request,
never both, and `num_free_blocks + blocks in use == num_blocks` at all times.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self._ref_count[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._ref_count[b] -= 1
            assert self._ref_count[b] >= 0, f"block {b} released more often than taken"
            if self._ref_count[b] == 0:
                self._free.append(b)


class KVCacheManager:
    """Block tables per request, growing as the request's computed tokens grow."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

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

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_total_tokens` tokens.

        Returns the newly added block ids, or None (and changes nothing) when the pool is short.
        """
        table = self.block_tables.setdefault(request_id, [])
        missing = self.blocks_needed(num_total_tokens) - len(table)
        if missing <= 0:
            return []
        if missing > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request_id]
            return None
        new_blocks = self.pool.allocate(missing)
        table.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            # Released in reverse so the tail blocks, least likely to be shared later, return first.
            self.pool.release(list(reversed(table)))

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])
