"""The measured cost model of speculative decoding: how many drafts to verify this step.

A verify step of k drafts per request costs more than a plain decode step, and it pays only if
the drafts accepted make up for it. With a_i the probability that draft i is accepted given that
drafts 0..i-1 were, a request gets E(k) = sum_{j=0..k} prod_{i<j} a_i tokens from a verify step
(the j = 0 term is the token the target samples itself). For a batch of B requests the chooser
picks the k that maximises tokens per second,

    B * E(k) / (verify(B, k) + draft(B, k))      against      B / plain(B)   for k = 0,

with verify, draft and plain (= verify(B, 0)) read from a calibration table that
`met benchmark spec-cost-table` measured on this GPU for this target and drafter
(bench/spec_cost_table.py). Between two measured batch sizes the times are interpolated
linearly; outside the measured range the nearest measured batch size is used (the choice depends
only on the ratios of the times, and those change slowly at the ends of a grid that spans
1..256). Only the k the table measured, up to num_speculative_tokens, are candidates.

The acceptance a_i is a running estimate per position: a Beta-like prior (mean `prior`, weight
`prior_weight` pseudo-drafts) plus the verify results observed, each weighted by how recent it is
(half-life `half_life` observations at that position). When the estimate says k = 0 but the
prior alone would draft, every `probe_every`-th such step verifies one draft, so that an estimate
made on text that drafted badly can recover when the text changes.

Torch-free, like the scheduler that calls it.
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import dataclass, field

from metrale.config.errors import OptionError

logger = logging.getLogger(__name__)

TABLE_FORMAT = "met-spec-cost-table/1"
# The identity keys a table must match to be used; anything else it records is provenance.
IDENTITY_KEYS = ("drafter", "target", "device")


@dataclass(frozen=True)
class CostTable:
    """Step times (seconds) measured per batch size and draft count: verify_s[b][i] is a verify
    step of batch_sizes[b] requests with num_drafts[i] drafts each (num_drafts[0] == 0: a plain
    decode step), draft_s[b][i] the drafter's time to propose them."""
    batch_sizes: tuple[int, ...]
    num_drafts: tuple[int, ...]
    verify_s: tuple[tuple[float, ...], ...]
    draft_s: tuple[tuple[float, ...], ...]
    identity: dict = field(default_factory=dict)
    recorded: dict = field(default_factory=dict)

    # -- JSON ----------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"format": TABLE_FORMAT, "identity": self.identity, "recorded": self.recorded,
                "batch_sizes": list(self.batch_sizes), "num_drafts": list(self.num_drafts),
                "verify_s": [list(row) for row in self.verify_s], "draft_s": [list(row) for row in self.draft_s],
                "verify_over_plain": {str(b): [v / row[0] for v in row]
                                      for b, row in zip(self.batch_sizes, self.verify_s)}}

    @classmethod
    def from_json(cls, data, source: str = "the table") -> "CostTable":
        """A table from its JSON object; OptionError names what is malformed."""
        def bad(what: str) -> OptionError:
            return OptionError(f"spec-cost calibration {source} is malformed: {what} (write it with "
                               f"`met benchmark spec-cost-table`)")

        if not isinstance(data, dict):
            raise bad("not a JSON object")
        if data.get("format") != TABLE_FORMAT:
            raise bad(f"format is {data.get('format')!r}, expected {TABLE_FORMAT!r}")
        for key in ("identity", "batch_sizes", "num_drafts", "verify_s", "draft_s"):
            if key not in data:
                raise bad(f"no {key!r}")
        if not isinstance(data["identity"], dict) or any(k not in data["identity"] for k in IDENTITY_KEYS):
            raise bad(f"'identity' must hold {', '.join(IDENTITY_KEYS)}")
        batch_sizes, num_drafts = data["batch_sizes"], data["num_drafts"]
        for name, values in (("batch_sizes", batch_sizes), ("num_drafts", num_drafts)):
            if (not isinstance(values, list) or not values
                    or any(not isinstance(v, int) or isinstance(v, bool) for v in values)
                    or values != sorted(set(values))):
                raise bad(f"{name!r} must be a non-empty ascending list of distinct integers")
        if batch_sizes[0] < 1:
            raise bad("batch sizes start at 1")
        if num_drafts[0] != 0:
            raise bad("'num_drafts' must start at 0 (the plain step every choice is weighed against)")
        if len(num_drafts) < 2:
            raise bad("'num_drafts' holds no draft count above 0")
        grids = []
        for key in ("verify_s", "draft_s"):
            grid = data[key]
            if (not isinstance(grid, list) or len(grid) != len(batch_sizes)
                    or any(not isinstance(row, list) or len(row) != len(num_drafts) for row in grid)):
                raise bad(f"{key!r} must be {len(batch_sizes)} rows (batch sizes) of {len(num_drafts)} "
                          "times (draft counts)")
            if any(not isinstance(t, (int, float)) or isinstance(t, bool) or not t >= 0 for row in grid for t in row):
                raise bad(f"{key!r} holds a time that is not a number >= 0")
            grids.append(tuple(tuple(float(t) for t in row) for row in grid))
        if any(row[0] <= 0 for row in grids[0]):
            raise bad("a plain step (k = 0) takes no time")
        return cls(tuple(batch_sizes), tuple(num_drafts), grids[0], grids[1], data["identity"],
                   data.get("recorded", {}))

    @classmethod
    def load(cls, path: str) -> "CostTable":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise OptionError(f"spec-cost calibration {path}: cannot read it: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OptionError(f"spec-cost calibration {path} is malformed: not JSON ({e})") from None
        return cls.from_json(data, path)

    def check_identity(self, identity: dict, source: str = "the table") -> None:
        """Refuse a table measured for another drafter, target or device: OptionError lists
        every identity field that differs, the table's value against this engine's."""
        ours, theirs = _flatten(identity), _flatten({k: self.identity.get(k) for k in IDENTITY_KEYS})
        differ = [f"{key}: table {theirs.get(key)!r}, this engine {ours.get(key)!r}"
                  for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key)]
        if differ:
            raise OptionError(f"spec-cost calibration {source} was measured for another setup; it differs in "
                              f"{'; '.join(differ)}. Measure this one with `met benchmark spec-cost-table`")

    # -- reading it ----------------------------------------------------------------------------

    def times(self, batch_size: int, k: int) -> tuple[float, float]:
        """(verify, draft) seconds of a step of `batch_size` requests with k drafts each
        (k one of num_drafts), interpolated between measured batch sizes, clipped at the ends."""
        column = self.num_drafts.index(k)
        sizes = self.batch_sizes
        b = min(max(batch_size, sizes[0]), sizes[-1])
        high = bisect.bisect_left(sizes, b)
        if sizes[high] == b:
            return self.verify_s[high][column], self.draft_s[high][column]
        low = high - 1
        w = (b - sizes[low]) / (sizes[high] - sizes[low])
        return tuple((1 - w) * grid[low][column] + w * grid[high][column]
                     for grid in (self.verify_s, self.draft_s))


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        flat = {}
        for key, inner in value.items():
            flat.update(_flatten(inner, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


def expected_tokens(acceptance: list[float], k: int) -> float:
    """E(k) = sum_{j=0..k} prod_{i<j} a_i: tokens one verify step of k drafts gives a request."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= acceptance[i]
        total += reach
    return total


class DraftLengthChooser:
    """Picks k per step from a CostTable and the acceptance observed so far (module docstring)."""

    def __init__(self, table: CostTable, max_drafts: int, prior: float = 0.6, prior_weight: float = 4.0,
                 half_life: float = 256.0, probe_every: int = 64):
        if not 0.0 <= prior <= 1.0 or prior_weight <= 0 or half_life <= 0 or probe_every < 1 or max_drafts < 1:
            raise ValueError("DraftLengthChooser: need 0 <= prior <= 1, prior_weight > 0, half_life > 0, "
                             "probe_every >= 1, max_drafts >= 1")
        self.table = table
        self.candidates = [k for k in table.num_drafts if k <= max_drafts]
        if len(self.candidates) < 2:
            raise OptionError(f"the spec-cost table measured draft counts {list(table.num_drafts)}, none of them "
                              f"between 1 and num_speculative_tokens {max_drafts}")
        self.max_drafts = max(self.candidates)
        self.prior, self.prior_weight = prior, prior_weight
        self._decay = 0.5 ** (1.0 / half_life)
        self._probe_every = probe_every
        # Per position i < max_drafts: decayed counts of drafts that reached i, and of those accepted there.
        self._trials = [0.0] * self.max_drafts
        self._accepts = [0.0] * self.max_drafts
        self._zero_streak = 0
        self._warned_beyond = False
        self.last_choice: int | None = None
        self.steps_per_k: dict[int, int] = {}  # how often each k was chosen (logs, tests)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify result: its first num_accepted of num_drafts drafts accepted."""
        for i in range(min(num_drafts, self.max_drafts)):
            if i > num_accepted:
                break  # never reached: a draft is judged only after all before it were accepted
            self._trials[i] = self._trials[i] * self._decay + 1.0
            self._accepts[i] = self._accepts[i] * self._decay + (1.0 if i < num_accepted else 0.0)

    def acceptance(self) -> list[float]:
        """a_i, the estimated chance draft i is accepted given drafts 0..i-1 were."""
        w = self.prior_weight
        return [(a + w * self.prior) / (t + w) for a, t in zip(self._accepts, self._trials)]

    def best(self, batch_size: int, acceptance: list[float]) -> int:
        """The candidate k with the most tokens per second at this batch size (k = 0 on a tie)."""
        best_k, best_rate = 0, 0.0
        for k in self.candidates:
            verify, draft = self.table.times(batch_size, k)
            rate = expected_tokens(acceptance, k) / (verify + draft)
            if rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        return best_k

    def choose(self, batch_size: int) -> int:
        """The number of drafts per request for a step of `batch_size` decoding requests."""
        if batch_size > self.table.batch_sizes[-1] and not self._warned_beyond:
            self._warned_beyond = True
            logger.warning("speculative decoding: batch %d is beyond the spec-cost table's largest measured batch "
                           "%d; that batch's step times decide k (measure larger batches with "
                           "--batch-sizes)", batch_size, self.table.batch_sizes[-1])
        k = self.best(batch_size, self.acceptance())
        if k == 0 and self.best(batch_size, [self.prior] * self.max_drafts) > 0:
            self._zero_streak += 1
            if self._zero_streak >= self._probe_every:
                self._zero_streak = 0
                k = min(c for c in self.candidates if c > 0)  # a probe: the cheapest draft that teaches
        else:
            self._zero_streak = 0
        self.last_choice = k
        self.steps_per_k[k] = self.steps_per_k.get(k, 0) + 1
        return k
