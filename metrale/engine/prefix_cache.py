"""The automatic prefix cache's bookkeeping per request: the hash chain of its full blocks, and
how many of its table's leading blocks are registered in the block pool for later requests.

A hash covers the block's tokens and, through its parent, everything before it, plus the
request's extra keys (an adapter, media hashes): two requests share a block, or a state
checkpoint, only if their whole prefixes up to it are equal.
"""

from __future__ import annotations

from metrale.engine.block_pool import BlockPool, block_hash


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size
        self._hashes: dict[str, list[bytes]] = {}  # the request's full-block hashes so far
        self._num_registered: dict[str, int] = {}  # leading blocks of its table registered in the pool

    def block_hashes(self, request_id: str, token_ids: list[int], extra_keys: tuple, num_tokens: int,
                     media: tuple = ()) -> list[bytes]:
        """Hashes of the full blocks among the first `num_tokens` of `token_ids` (extended
        incrementally: a request's earlier hashes never change). `media`: (start, end, content
        hash) of each media span; a block that overlaps a span has its hash in its key (the
        placeholder tokens alone are equal for any two images), and every later block chains it."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            keys = extra_keys + tuple(h for start, end, h in media if start < (i + 1) * bs and end > i * bs)
            hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs], keys))
        return hashes

    def cached_blocks(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest cached run of `hashes` (no references taken)."""
        hits = []
        for h in hashes:
            block = self.pool.cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def adopt(self, request_id: str, num_shared_blocks: int) -> None:
        """A new table starts with `num_shared_blocks` cached blocks: they are registered already."""
        self._num_registered[request_id] = num_shared_blocks

    def register(self, request_id: str, table: list[int], token_ids: list[int], extra_keys: tuple,
                 num_computed_tokens: int, media: tuple = ()) -> None:
        """Register the request's blocks that are full and computed, for later requests.
        `num_computed_tokens` must not reach past tokens whose values are known."""
        done = self._num_registered.get(request_id, 0)
        full = min(num_computed_tokens // self.block_size, len(table))
        if full <= done:
            return
        hashes = self.block_hashes(request_id, token_ids, extra_keys, num_computed_tokens, media)
        for i in range(done, full):
            self.pool.register(table[i], hashes[i])
        self._num_registered[request_id] = full

    def forget(self, request_id: str, keep_hashes: bool) -> None:
        """The request gave its table back; a preempted one keeps its hashes for its return."""
        self._num_registered.pop(request_id, None)
        if not keep_hashes:
            self._hashes.pop(request_id, None)
