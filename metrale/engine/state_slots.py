"""The pool of per-request state slots (models with linear-attention layers), and the prefix
cache's checkpoints of such state.

No torch here: the pool hands out slot ids; the model runner owns the state tensors they index
(one row per slot in every state cache of every layer).

Slots 0..num_running-1 are running slots: each running request holds exactly one, from
admission to finish or preemption. Slots num_running..num_running+num_checkpoints-1 are
checkpoint slots: each holds, or will hold once its step has run, the state of some request at a
block-aligned position, keyed by the content hash of the block that ends there (the hash chain
covers the whole prefix). Invariants:
- a checkpoint slot's hash, while registered, names state that is on the device by the time any
  later step reads it (saves are queued on the device before every later step's restores);
- a slot that is a restore source or a save destination in the step being planned is pinned
  until the next step is planned: it is neither evicted nor given another hash in between;
- unpinned checkpoint slots sit in LRU order, least recently used first; eviction drops the
  hash, so a later lookup can never resume from state that was overwritten.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlotPool:
    def __init__(self, num_running: int, num_checkpoints: int = 0):
        self.num_running, self.num_checkpoints = num_running, num_checkpoints
        self._free_running = list(range(num_running - 1, -1, -1))  # pop() takes the lowest first
        self._lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_running, num_running + num_checkpoints))
        self._hash_of: dict[int, bytes] = {}
        self._slot_of: dict[bytes, int] = {}
        self._pinned: list[int] = []

    # -- running slots -----------------------------------------------------------------------

    @property
    def num_free_running(self) -> int:
        return len(self._free_running)

    def allocate(self) -> int | None:
        return self._free_running.pop() if self._free_running else None

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.num_running and slot not in self._free_running, f"slot {slot} released twice"
        self._free_running.append(slot)

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint(self, content_hash: bytes) -> int | None:
        return self._slot_of.get(content_hash)

    def use_checkpoint(self, slot: int) -> None:
        """A restore source this step: pinned, and most recently used once unpinned."""
        self._pin(slot)

    def save_checkpoint(self, content_hash: bytes) -> int | None:
        """A checkpoint slot for the state at the end of the block `content_hash` names, evicting
        the least recently used unpinned one; None when every slot is pinned or the state is
        already kept."""
        if content_hash in self._slot_of or not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        old = self._hash_of.pop(slot, None)
        if old is not None:
            del self._slot_of[old]
        self._hash_of[slot], self._slot_of[content_hash] = content_hash, slot
        self._pinned.append(slot)
        return slot

    def _pin(self, slot: int) -> None:
        if slot in self._lru:
            del self._lru[slot]
            self._pinned.append(slot)

    def end_step(self) -> None:
        """The planned step's copies are queued on the device: unpin its slots."""
        for slot in self._pinned:
            self._lru[slot] = None
        self._pinned = []
