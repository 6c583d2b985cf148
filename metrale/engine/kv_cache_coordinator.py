"""The cache coordinator: the block pool, the state-slot pool and the prefix cache behind one
interface, so the scheduler asks for room for a request and never touches a pool.

No torch here. Per request it keeps a block table (every paged cache of every layer shares it)
and, for models with per-request state, a running state slot.

Prefix hits are the minimum over every kind of cache the model keeps:
- paged caches alone: the longest run of cached full blocks. When that covers the whole prompt,
  the last token still runs for its logits, in a private copy of the last block (copy on write);
- with state: state can only resume from a checkpoint, so the hit is the longest cached run of
  blocks whose last block has a state checkpoint, and it stops short of the last token (which
  must run). A hit never skips tokens whose state is gone.
Checkpoints are saved at one block-aligned position per request, the last block boundary before
its last known token: the request's chunk is cut to end there, and the state is copied into a
checkpoint slot after that step. A later request with the same prefix (the same prompt, or a
conversation that continues it) resumes there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.engine.block_pool import BlockPool
from metrale.engine.prefix_cache import PrefixCache
from metrale.engine.request import Request
from metrale.engine.state_slots import StateSlotPool


@dataclass
class PrefixHit:
    num_tokens: int = 0  # tokens whose caches are reused
    blocks: list[int] = field(default_factory=list)  # shared blocks, from the table's start
    copy_last_from: int | None = None  # a fully cached prompt: the block to copy for its last token
    state_source: int | None = None  # the checkpoint slot the request's state resumes from


@dataclass
class Admission:
    end: int  # the first chunk computes tokens [hit.num_tokens, end)
    block_table: list[int]
    state_slot: int  # -1: the model keeps no state
    block_copies: list[tuple[int, int]]
    state_restores: list[tuple[int, int]]


class KVCacheCoordinator:
    def __init__(self, num_blocks: int, block_size: int, *, num_state_slots: int = 0,
                 num_checkpoint_slots: int = 0, enable_prefix_caching: bool = False):
        """`num_state_slots`: running slots, 0 for a model without per-request state (then no
        checkpoints either). A model with state and no checkpoint slot has no prefix cache."""
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.has_state = num_state_slots > 0
        self.slots = StateSlotPool(num_state_slots, num_checkpoint_slots if self.has_state else 0)
        self.enable_prefix_caching = enable_prefix_caching and (not self.has_state or num_checkpoint_slots > 0)
        self.prefix = PrefixCache(self.blocks, block_size)
        self.block_tables: dict[str, list[int]] = {}
        self.state_slot_of: dict[str, int] = {}
        self._checkpoint_at: dict[str, int] = {}  # request -> the position its state is saved at
        self._pinned_blocks: list[int] = []  # copy-on-write sources of the step being planned
        self.prefix_queries_total = 0  # tokens looked up in the prefix cache
        self.prefix_hits_total = 0  # of those, tokens found
        self.checkpoints_saved_total = 0

    # -- sizes -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.blocks.num_free_blocks / self.blocks.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.block_size

    @property
    def num_free_state_slots(self) -> int:
        return self.slots.num_free_running

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    # -- admission ---------------------------------------------------------------------------

    def lookup(self, request: Request) -> PrefixHit:
        """The longest reusable prefix of a waiting request (no references taken)."""
        if not self.enable_prefix_caching:
            return PrefixHit()
        known = request.num_known_tokens
        hashes = self.prefix.block_hashes(request.request_id, request.token_ids, request.extra_keys, known,
                                           request.media_keys)
        blocks = self.prefix.cached_blocks(hashes)
        bs = self.block_size
        if self.has_state:
            for n in range(min(len(blocks), (known - 1) // bs), 0, -1):
                source = self.slots.checkpoint(hashes[n - 1])
                if source is not None:
                    return PrefixHit(n * bs, blocks[:n], state_source=source)
            return PrefixHit()
        if blocks and len(blocks) * bs >= known:
            # Everything is cached, but the last token must run for its logits.
            return PrefixHit(known - 1, blocks[:-1], copy_last_from=blocks[-1])
        return PrefixHit(len(blocks) * bs, blocks)

    def admit(self, request: Request, hit: PrefixHit, max_end: int) -> Admission | None:
        """Room for the request's first chunk, [hit.num_tokens, end) with end <= max_end (cut at
        its checkpoint position): a table that starts with the hit's blocks, a state slot and the
        copies that resume the hit. None (and nothing changed) when a pool is short."""
        rid = request.request_id
        checkpoint = self._checkpoint_position(request) if self.has_state and self.enable_prefix_caching else 0
        end = checkpoint if hit.num_tokens < checkpoint < max_end else max_end
        shared = hit.blocks + ([hit.copy_last_from] if hit.copy_last_from is not None else [])
        missing = max(0, self.blocks_needed(end) - len(hit.blocks))
        reclaimed = sum(1 for b in set(shared) if self.blocks.ref_count(b) == 0)  # free now, not once taken
        if missing > self.blocks.num_free_blocks - reclaimed:
            return None
        slot = -1
        if self.has_state:
            slot = self.slots.allocate()
            if slot is None:
                return None
        self.blocks.touch(shared)
        table = hit.blocks + self.blocks.allocate(missing)
        self.block_tables[rid] = table
        self.prefix.adopt(rid, len(hit.blocks))
        block_copies, state_restores = [], []
        if hit.copy_last_from is not None:
            block_copies.append((hit.copy_last_from, table[len(hit.blocks)]))
            self._pinned_blocks.append(hit.copy_last_from)  # released once the copy has run
        if self.has_state:
            self.state_slot_of[rid] = slot
            if hit.state_source is not None:
                self.slots.use_checkpoint(hit.state_source)
                state_restores.append((hit.state_source, slot))
            if checkpoint > hit.num_tokens:
                self._checkpoint_at[rid] = checkpoint
        if self.enable_prefix_caching:
            self.prefix_queries_total += request.num_tokens
            self.prefix_hits_total += hit.num_tokens
        return Admission(end, list(table), slot, block_copies, state_restores)

    def _checkpoint_position(self, request: Request) -> int:
        """The last block boundary before the request's last known token."""
        return (request.num_known_tokens - 1) // self.block_size * self.block_size

    # -- running requests --------------------------------------------------------------------

    def grow(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Blocks added to the request's table so it holds `num_total_tokens` tokens, or None
        (and nothing changed) when the pool is short."""
        table = self.block_tables.setdefault(request_id, [])
        missing = self.blocks_needed(num_total_tokens) - len(table)
        if missing <= 0:
            return []  # the common decode step: the last block still has room
        if missing > self.blocks.num_free_blocks:
            return None
        new_blocks = self.blocks.allocate(missing)
        table.extend(new_blocks)
        return new_blocks

    def chunk_end(self, request_id: str, start: int, end: int) -> int:
        """Where a chunk [start, end) of the request ends: cut at its checkpoint position, so the
        state there can be saved."""
        position = self._checkpoint_at.get(request_id)
        return position if position is not None and start < position < end else end

    def save_checkpoint(self, request: Request, end: int) -> tuple[int, int] | None:
        """(request slot, checkpoint slot) when the chunk planned for the request ends at its
        checkpoint position; the checkpoint is registered now (the copy runs after this step's
        forward pass, before any later step reads it)."""
        rid = request.request_id
        if self._checkpoint_at.get(rid) != end:
            return None
        del self._checkpoint_at[rid]
        hashes = self.prefix.block_hashes(rid, request.token_ids, request.extra_keys, end, request.media_keys)
        destination = self.slots.save_checkpoint(hashes[end // self.block_size - 1])
        if destination is None:
            return None
        self.checkpoints_saved_total += 1
        return self.state_slot_of[rid], destination

    def cache_computed(self, request: Request, num_computed_tokens: int) -> None:
        """Offer the request's full computed blocks to later requests."""
        if self.enable_prefix_caching:
            self.prefix.register(request.request_id, self.block_tables.get(request.request_id, []),
                                 request.token_ids, request.extra_keys, num_computed_tokens, request.media_keys)

    def free(self, request_id: str, preempted: bool = False) -> None:
        """Give the request's blocks and slot back; a preempted request keeps its hashes."""
        table = self.block_tables.pop(request_id, None)
        self.prefix.forget(request_id, keep_hashes=preempted)
        self._checkpoint_at.pop(request_id, None)
        slot = self.state_slot_of.pop(request_id, None)
        if slot is not None:
            self.slots.release(slot)
        if table:
            # Released in reverse: a prefix's tail blocks are evicted before its head, which
            # more requests are likely to share.
            self.blocks.release(list(reversed(table)))

    def end_step(self) -> None:
        """The last planned step's copies are queued on the device: unpin their sources."""
        self.blocks.release(self._pinned_blocks)
        self._pinned_blocks = []
        self.slots.end_step()
