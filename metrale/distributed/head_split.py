"""How heads split over the tensor-parallel ranks, evenly or not (torch-free: the startup checks
and the layers read the same rules).

A head count that does not divide over the ranks is split as evenly as possible: the first
`n % tp` ranks take one head more (`split_evenly`). Layers built on it hold an explicit per-rank
partition (layers/linear.py: `output_partition`, `input_partition`), so the checkpoint slices
start where the earlier ranks' heads end.

MHA / GQA attention (`attention_split`), with H query heads over K KV heads, G = H / K per group:
- K >= tp: the KV heads split as evenly as possible and every rank takes the whole query groups
  of its KV heads (G query heads each), so no group is cut: e.g. H=10, K=5, tp=3 gives KV heads
  2/2/1 and query heads 4/4/2.
- K < tp: each KV head is replicated on tp / K ranks (tp must be a multiple of K), and its G
  query heads split evenly over those ranks (H must divide over tp). Splitting a group unevenly
  over its replicas is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass


def split_evenly(count: int, parts: int) -> tuple[int, ...]:
    """`count` split over `parts` as evenly as possible, the first `count % parts` one larger."""
    if parts < 1:
        raise ValueError(f"cannot split over {parts} ranks")
    base, extra = divmod(count, parts)
    return tuple(base + (rank < extra) for rank in range(parts))


def split_heads(count: int, parts: int, what: str) -> tuple[int, ...]:
    """`split_evenly` for heads: every rank must hold at least one (ValueError naming `what`)."""
    if count < parts:
        raise ValueError(f"{count} {what} cannot be split over {parts} tensor-parallel ranks: every rank needs at "
                         f"least one; use a tp size of at most {count}")
    return split_evenly(count, parts)


def starts_of(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Where each rank's share begins: the sum of the shares before it."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return tuple(starts)


def scaled(heads_per_rank: tuple[int, ...], width: int) -> tuple[int, ...]:
    """Per-rank head counts -> per-rank features (heads x head width)."""
    return tuple(heads * width for heads in heads_per_rank)


def is_uneven(sizes: tuple[int, ...]) -> bool:
    return len(set(sizes)) > 1


def per_rank(sizes: tuple[int, ...]) -> str:
    """2/2/1: what the uneven-split log line and refusals print."""
    return "/".join(map(str, sizes))


@dataclass(frozen=True)
class AttentionSplit:
    """Per rank: its query heads, its KV heads, and the checkpoint index of the first of each."""
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    q_start: tuple[int, ...]
    kv_start: tuple[int, ...]

    @property
    def uneven(self) -> bool:
        return is_uneven(self.q_heads) or is_uneven(self.kv_heads)

    def describe(self) -> str:
        return f"query heads {per_rank(self.q_heads)}, KV heads {per_rank(self.kv_heads)} per rank"


def working_tp_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """The tp sizes `attention_split` accepts: up to the KV head count (unevenly where need be),
    or a multiple of it that divides the query heads."""
    return [t for t in range(1, num_heads + 1)
            if t <= num_kv_heads or (t % num_kv_heads == 0 and num_heads % t == 0)]


def attention_split(num_heads: int, num_kv_heads: int, tp_size: int) -> AttentionSplit:
    """The split of the module docstring; ValueError naming the sizes for what it refuses."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not form whole groups over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_heads = split_evenly(num_kv_heads, tp_size)
        q_heads = scaled(kv_heads, group)
        return AttentionSplit(q_heads, kv_heads, starts_of(q_heads), starts_of(kv_heads))
    if tp_size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} KV heads cannot be replicated evenly over tp_size={tp_size} (tp_size must be a "
            f"multiple of the KV head count to replicate each head on the same number of ranks)")
    replicas = tp_size // num_kv_heads
    if group % replicas:
        sizes = ", ".join(map(str, working_tp_sizes(num_heads, num_kv_heads)))
        raise ValueError(
            f"{num_heads} attention heads cannot be split evenly over tp_size={tp_size}, and with fewer KV heads "
            f"({num_kv_heads}) than ranks an uneven split would cut a KV head's query group over its replicas, "
            f"which met does not do; tensor-parallel sizes that work: {sizes}")
    q_local = num_heads // tp_size
    ranks = range(tp_size)
    return AttentionSplit((q_local,) * tp_size, (1,) * tp_size, tuple(r * q_local for r in ranks),
                          tuple(r // replicas for r in ranks))
