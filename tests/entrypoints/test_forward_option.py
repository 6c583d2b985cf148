"""--forward graphs|eager|reference (issue 20): resolved per device, refused where it cannot run,
and the PyTorch path of every layer under `reference` (kernels.kernel_path)."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM
from metrale.config.engine_args import EngineArgs
from metrale.config.errors import OptionError
from metrale.kernels import kernel_path, use_triton
from metrale.startup.model_source import resolve_forward

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("kwargs,device,expected", [
    ({}, CUDA, "graphs"),
    (dict(enforce_eager=True), CUDA, "eager"),
    (dict(forward="eager"), CUDA, "eager"),
    (dict(forward="reference"), CUDA, "reference"),
    ({}, CPU, "reference"),
    (dict(forward="reference"), CPU, "reference"),
])
def test_forward_resolves_per_device(kwargs, device, expected):
    assert resolve_forward(EngineArgs(**kwargs), device) == expected


@pytest.mark.parametrize("kwargs,device,message", [
    (dict(forward="graphs"), CPU, "need a CUDA device"),
    (dict(forward="eager"), CPU, "need a CUDA device"),  # without the interpreter (below)
    (dict(forward="graphs", enforce_eager=True), CUDA, "forbids"),
    (dict(forward="reference", attention_backend="triton"), CUDA, "drop --attention-backend triton"),
])
def test_forward_that_cannot_run_is_refused(kwargs, device, message, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(OptionError, match=message):
        resolve_forward(EngineArgs(**kwargs), device)


def test_eager_on_a_cpu_runs_the_kernels_through_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_forward(EngineArgs(forward="eager"), CPU) == "eager"


def test_reference_forward_turns_every_dispatcher_to_pytorch():
    class FakeCuda:
        is_cuda = True

    from metrale.kernels import HAS_TRITON

    assert use_triton(FakeCuda()) == HAS_TRITON
    with kernel_path("reference"):
        assert not use_triton(FakeCuda())
    assert use_triton(FakeCuda()) == HAS_TRITON


def test_cpu_engine_reports_its_forward(checkpoint_factory):
    llm = LLM(checkpoint_factory("llama"), device="cpu", dtype="float32")
    assert llm.llm_engine.runner.forward_mode == "reference" and llm.llm_engine.runner.reference
    with pytest.raises(OptionError, match="CUDA"):
        LLM(checkpoint_factory("llama"), device="cpu", forward="graphs")
