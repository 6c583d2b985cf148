"""The kernel audit of startup (phase 7) and `met serve --check-kernels`.

While it is open, every Triton launch is recorded: the kernel, its variant (the compile-time
constants and the element types of its tensor arguments, which is what Triton specialises on),
whether the variant was compiled now, was already compiled in this process, ran through the
interpreter, or could not be built, and the time its first launch took. The audit opens before
the first forward of startup (the activation profile on CUDA) and closes after the warm-up
(kernel_warmup.py), so it lists every variant the chosen forward compiled for this model, dtype
and GPU. A variant that cannot be built fails startup, naming it.

The recording wraps `JITFunction.run` (and the interpreter's `InterpretedFunction.run`) for the
audit's duration only; nothing is patched while the engine serves.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, field

import torch

from metrale.config.errors import StartupError
from metrale.kernels import HAS_TRITON, interpret_mode

# A first launch slower than this compiled its variant (a load from Triton's disk cache takes ms).
COMPILE_SECONDS = 0.05


class KernelBuildError(StartupError):
    """A Triton kernel variant the forward needs cannot be built on this device."""

    report: "KernelReport | None" = None  # the whole audit, set where startup raises it


@dataclass
class Variant:
    kernel: str  # module.function
    variant: str
    status: str = "cached"  # compiled | cached | interpreted | unresolved
    seconds: float = 0.0
    launches: int = 0
    error: str = ""


@dataclass
class KernelReport:
    variants: dict[tuple[str, str], Variant] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def unresolved(self) -> list[Variant]:
        return [v for v in self.variants.values() if v.status == "unresolved"]

    def count(self, status: str) -> int:
        return sum(v.status == status for v in self.variants.values())

    def summary(self) -> str:
        counts = ", ".join(f"{self.count(s)} {s}" for s in ("compiled", "cached", "interpreted", "unresolved")
                           if self.count(s))
        return f"{len(self.variants)} Triton kernel variant(s){': ' + counts if counts else ''} ({self.seconds:.2f}s)"

    def table(self) -> str:
        rows = sorted(self.variants.values(), key=lambda v: (v.kernel, v.variant))
        width = max([len(v.kernel) for v in rows] + [6])
        lines = [f"{'kernel':<{width}}  {'status':<11}  {'time':>7}  variant"]
        for v in rows:
            lines.append(f"{v.kernel:<{width}}  {v.status:<11}  {v.seconds:6.2f}s  {v.variant}"
                         + (f"  ERROR: {v.error}" if v.error else ""))
        lines.append(self.summary())
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"summary": self.summary(), "variants": [vars(v) for v in self.variants.values()]}


@functools.lru_cache(maxsize=None)
def _parameters(inner) -> tuple[list[str], frozenset[str]]:
    """A kernel's argument names and those annotated tl.constexpr (compiled in)."""
    params = inspect.signature(inner).parameters.values()
    constexprs = frozenset(p.name for p in params if "constexpr" in str(p.annotation))
    return [p.name for p in params], constexprs


def _describe(fn, args: tuple, kwargs: dict) -> tuple[str, str]:
    inner = getattr(fn, "fn", fn)
    name = f"{inner.__module__.rsplit('.', 1)[-1]}.{inner.__name__}"
    arg_names, constexprs = _parameters(inner)
    bound = dict(zip(arg_names, args), **kwargs)
    parts = [f"{k}={bound[k]}" for k in arg_names if k in constexprs and k in bound]
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in bound.values() if isinstance(v, torch.Tensor)})
    if dtypes:
        parts.append("dtypes=" + "/".join(dtypes))
    return name, ", ".join(parts)


@contextlib.contextmanager
def kernel_audit():
    """Record every Triton launch inside; yields the KernelReport it fills."""
    report = KernelReport()
    if not HAS_TRITON:
        yield report
        return
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    interpreted = interpret_mode()
    originals = {cls: cls.run for cls in classes}

    def recording(original):
        def run(self, *args, **kwargs):
            key = _describe(self, args, {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")})
            variant = report.variants.get(key)
            first = variant is None
            if first:
                variant = report.variants[key] = Variant(*key)
            variant.launches += 1
            start = time.perf_counter()
            try:
                result = original(self, *args, **kwargs)
            except Exception as e:
                variant.status, variant.error = "unresolved", f"{type(e).__name__}: {e}".splitlines()[0][:300]
                raise
            if first:
                variant.seconds = time.perf_counter() - start
                variant.status = ("interpreted" if interpreted
                                  else "compiled" if variant.seconds > COMPILE_SECONDS else "cached")
            return result
        return run

    started = time.perf_counter()
    for cls, original in originals.items():
        cls.run = recording(original)
    try:
        yield report
    finally:
        for cls, original in originals.items():
            cls.run = original
        report.seconds = time.perf_counter() - started


def run_audited(report: KernelReport, steps) -> None:
    """Run each (name, fn) step of a warm-up; a step whose kernel cannot be built is recorded
    (its variant unresolved) and the next step still runs."""
    for _, step in steps:
        try:
            step()
        except Exception:  # noqa: BLE001 - recorded as the unresolved variant; reported by the caller
            if not report.unresolved:
                raise


def build_error(report: KernelReport) -> KernelBuildError:
    """The startup error naming the variants that cannot be built, carrying the whole report."""
    names = "; ".join(f"{v.kernel} [{v.variant}]: {v.error}" for v in report.unresolved)
    error = KernelBuildError(f"kernel audit: {len(report.unresolved)} Triton kernel variant(s) cannot be built "
                             f"on this device: {names} (met serve --check-kernels lists them all; "
                             f"--forward reference runs without them)")
    error.report = report
    return error
