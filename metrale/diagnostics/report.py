"""How far met's taps are from the reference's, tap by tap and request by request, and the report
`met circuit diff` prints (a table, or JSON).

Per tap and request, with ours = met's rows and ref = the reference's (float32, [rows, ...]):

    max abs   max |ours - ref|
    max rel   max |ours - ref| / max |ref|: the error against the tap's own scale (an element-wise
              ratio would blow up wherever ref crosses zero)
    cosine    the lowest cosine similarity of one token's row of ours and of ref
    worst     the request (of the largest max rel) and its prompt position of the largest abs
              diff: one token far off and the rest close is a different choice at a near tie
              (an MoE router's top-k), not a wrong weight

A tap is within tolerance when its max rel is at most `Tolerance.max_rel` and its cosine at
least `Tolerance.min_cosine`, for every request. The first tap in forward order that is not is
the first divergence.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Tolerance:
    max_rel: float
    min_cosine: float

    @classmethod
    def for_dtype(cls, dtype: str, max_rel: float | None = None, min_cosine: float | None = None) -> "Tolerance":
        """The default of a dtype ("float32", "bfloat16", ...), with either bound replaced when given."""
        default = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["bfloat16"])
        return cls(default.max_rel if max_rel is None else max_rel,
                   default.min_cosine if min_cosine is None else min_cosine)


# float32: both sides compute the same expressions in the same precision and differ by summation
# order only (max rel about 1e-6 on the tiny test checkpoints, 100x under the bound). 16-bit types
# round every intermediate value, and met's fused kernels round at other points than transformers'
# modules: bfloat16 reaches max rel 2.5e-2 and cosine 0.9997 within 2 to 4 layers of the tiny
# checkpoints; a real bug (a weight mapped wrong, RoPE off) drops the cosine of its tap far below.
DEFAULT_TOLERANCES = {
    "float32": Tolerance(max_rel=1e-4, min_cosine=0.99999),
    "float16": Tolerance(max_rel=1e-2, min_cosine=0.999),
    "bfloat16": Tolerance(max_rel=5e-2, min_cosine=0.995),
}


@dataclass(frozen=True)
class TapDiff:
    max_abs: float
    max_rel: float
    cosine: float
    worst_token: int  # the prompt position of the row with the largest abs diff

    @classmethod
    def of(cls, ours, ref, first_position: int = 0) -> "TapDiff":
        """ours, ref: float tensors of one shape, [rows, ...], row r at prompt position
        first_position + r."""
        if tuple(ours.shape) != tuple(ref.shape):
            raise ValueError(f"shapes differ: met {tuple(ours.shape)}, reference {tuple(ref.shape)}")
        ours, ref = ours.double().reshape(ours.shape[0], -1), ref.double().reshape(ref.shape[0], -1)
        row_abs = (ours - ref).abs().amax(dim=1)
        max_abs = float(row_abs.max())
        scale = float(ref.abs().max())
        max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
        norms = ours.norm(dim=1) * ref.norm(dim=1)
        both_zero = (ours.norm(dim=1) == 0) & (ref.norm(dim=1) == 0)
        cosine = ((ours * ref).sum(dim=1) / norms.clamp_min(1e-300)).clamp(-1.0, 1.0).masked_fill(both_zero, 1.0)
        # NaN counts as the worst; argmax alone would not find it.
        worst = int(row_abs.nan_to_num(math.inf).argmax())
        return cls(max_abs, max_rel, float(cosine.min()), first_position + worst)

    def within(self, tolerance: Tolerance) -> bool:
        return self.max_rel <= tolerance.max_rel and self.cosine >= tolerance.min_cosine


@dataclass
class TapRow:
    """One tap over every request: the worst of each measure, and the request with the largest max rel."""

    name: str
    per_request: list[TapDiff]

    @property
    def max_abs(self) -> float:
        return max(d.max_abs for d in self.per_request)

    @property
    def max_rel(self) -> float:
        return max(d.max_rel for d in self.per_request)

    @property
    def cosine(self) -> float:
        return min(d.cosine for d in self.per_request)

    @property
    def worst_request(self) -> int:
        rels = [d.max_rel if not math.isnan(d.max_rel) else math.inf for d in self.per_request]
        return max(range(len(rels)), key=rels.__getitem__)

    @property
    def worst_token(self) -> int:
        return self.per_request[self.worst_request].worst_token

    def within(self, tolerance: Tolerance) -> bool:
        return all(d.within(tolerance) for d in self.per_request)


@dataclass
class CircuitReport:
    model_dir: str
    architecture: str
    dtype: str
    device: str
    tp_size: int
    prompt_lens: list[int]
    tolerance: Tolerance
    tolerance_source: str  # "float32 defaults", "given", ...
    taps: list[TapRow] = field(default_factory=list)

    @property
    def first_divergence(self) -> TapRow | None:
        return next((row for row in self.taps if not row.within(self.tolerance)), None)

    @property
    def exit_status(self) -> int:
        """0: every tap within tolerance; 1: one is not (`met circuit diff` uses 2 for could not compare)."""
        return 0 if self.first_divergence is None else 1

    def divergence_line(self) -> str:
        row = self.first_divergence
        if row is None:
            return f"all {len(self.taps)} taps within tolerance"
        index = next(i for i, d in enumerate(row.per_request) if not d.within(self.tolerance))
        diff, tol = row.per_request[index], self.tolerance
        reasons = ([f"max rel {diff.max_rel:.3e} > {tol.max_rel:g}"] if diff.max_rel > tol.max_rel else []) + \
                  ([f"cosine {diff.cosine:.7f} < {tol.min_cosine:g}"] if diff.cosine < tol.min_cosine else [])
        return f"first divergence: {row.name} (request {index}: {', '.join(reasons)}; worst token {diff.worst_token})"

    def table(self) -> str:
        tol = self.tolerance
        lines = [f"met circuit diff: {self.model_dir} ({self.architecture}), {self.dtype} on {self.device}, "
                 f"tp {self.tp_size}; {len(self.prompt_lens)} request(s) of "
                 f"{', '.join(map(str, self.prompt_lens))} token(s)",
                 f"tolerance: max rel <= {tol.max_rel:g}, cosine >= {tol.min_cosine:g} ({self.tolerance_source})",
                 "max rel = max|met - ref| / max|ref|; cosine = the lowest over the tokens", ""]
        width = max([len("tap")] + [len(row.name) for row in self.taps])
        lines.append(f"{'tap':<{width}}  {'max abs':>10}  {'max rel':>10}  {'cosine':>10}  {'worst req:token':>15}")
        for row in self.taps:
            mark = "" if row.within(tol) else "  <- past tolerance"
            worst = f"{row.worst_request}:{row.worst_token}"
            lines.append(f"{row.name:<{width}}  {row.max_abs:>10.3e}  {row.max_rel:>10.3e}  {row.cosine:>10.7f}  "
                         f"{worst:>15}{mark}")
        lines += ["", self.divergence_line()]
        return "\n".join(lines)

    def to_json(self) -> dict:
        first = self.first_divergence
        return {
            "model": self.model_dir, "architecture": self.architecture, "dtype": self.dtype,
            "device": self.device, "tp_size": self.tp_size, "prompt_lens": self.prompt_lens,
            "tolerance": {**asdict(self.tolerance), "source": self.tolerance_source},
            "taps": [{"name": row.name, "max_abs": _number(row.max_abs), "max_rel": _number(row.max_rel),
                      "cosine": _number(row.cosine), "worst_request": row.worst_request,
                      "worst_token": row.worst_token,
                      "within_tolerance": row.within(self.tolerance),
                      "requests": [{k: _number(v) for k, v in asdict(d).items()} for d in row.per_request]}
                     for row in self.taps],
            "first_divergence": None if first is None else first.name,
            "summary": self.divergence_line(),
            "exit_status": self.exit_status,
        }


def _number(value: float) -> float | str:
    """Strict JSON has no NaN or infinity: those become the strings "nan", "inf"."""
    return value if math.isfinite(value) else str(value)


def compare_taps(names: list[str], ours: list[dict], theirs: list[dict]) -> list[TapRow]:
    """ours, theirs: per request, tap -> tensor. One TapRow per tap, in the order of `names`."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} requests of met's against {len(theirs)} of the reference")
    rows = []
    for name in names:
        # Every tap has a row per prompt position but the logits, which have the last one's.
        lens = [o[names[0]].shape[0] for o in ours]
        rows.append(TapRow(name, [TapDiff.of(o[name], t[name], n - o[name].shape[0])
                                  for o, t, n in zip(ours, theirs, lens)]))
    return rows
