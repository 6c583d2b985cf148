"""`met circuit diff` on tiny random checkpoints: every tap within tolerance for each family, a
layer perturbed in met's copy only named as the first divergence (exit status 1), tp=2 on the
CPU, and the JSON report.

Each family builds one engine and one transformers model (a few seconds on two cores). Prompts of
6 and 23 tokens under a 16-token step budget: the longer one is prefilled in two chunks, the
first beside the shorter prompt, so the taps are split per request and stitched across steps.
"""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import make_checkpoint
from hybrid_checkpoints import make_hybrid_checkpoint
from metrale.config.engine_args import EngineArgs
from metrale.diagnostics.circuit import circuit_diff, circuit_engine_args
from metrale.diagnostics.report import TapDiff, Tolerance
from metrale.entrypoints.cli import main
from metrale.startup import build_llm_engine
from moe_checkpoints import make_moe_checkpoint
from parallel_cases import free_port

PROMPTS = [[(37 * i + 11) % 380 + 3 for i in range(6)], [(53 * i + 7) % 380 + 3 for i in range(23)]]
STEP_BUDGET = 16
CLI_PROMPT = ["--prompt", "Hello, world! How are you?", "--prompt-token-ids", ",".join(map(str, PROMPTS[1]))]

FAMILIES = {
    "qwen3": (make_checkpoint, "qwen3"),
    "qwen3_moe": (make_moe_checkpoint, "qwen3_moe"),
    "minimax_m2": (make_moe_checkpoint, "minimax_m2"),
    "qwen3_next": (make_hybrid_checkpoint, "qwen3_next"),
    "qwen3_5": (make_hybrid_checkpoint, "qwen3_5"),
}  # llama: test_json_report_parses


@pytest.fixture(scope="module")
def family_checkpoint(tmp_path_factory):
    def get(family: str) -> str:
        make, name = FAMILIES[family]
        return make(str(tmp_path_factory.mktemp(f"circuit_{family}")), name)

    return get


def _engine(path: str, **kwargs):
    args = EngineArgs(model=path, dtype="float32", device="cpu", max_num_batched_tokens=STEP_BUDGET, **kwargs)
    return build_llm_engine(circuit_engine_args(args, len(PROMPTS)))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_tap_within_tolerance(family, family_checkpoint):
    engine = _engine(family_checkpoint(family))
    report = circuit_diff(engine, PROMPTS)
    layers = engine.model_config.num_layers
    assert [row.name for row in report.taps][:2] == ["embed", "layers.0." + engine.runner.model.model.layers[0].mixer_name]
    assert len(report.taps) == 3 + 2 * layers
    assert [row.name for row in report.taps][-2:] == ["norm", "logits"]
    assert all(len(row.per_request) == 2 for row in report.taps)
    assert report.first_divergence is None, report.table()
    assert report.exit_status == 0
    if family == "qwen3_next":  # hybrid: the linear-attention mixers have their own taps
        assert "layers.0.linear_attn" in [row.name for row in report.taps]


def test_perturbed_layer_is_the_first_divergence(checkpoint_factory, monkeypatch, capsys):
    """Layer 1's o_proj changed in met's loaded copy only: everything before layer 1's attention
    tap agrees, that tap is named, and the command exits with 1."""
    import metrale.startup

    build = metrale.startup.build_llm_engine

    def build_and_perturb(args, *a, **kw):
        engine = build(args, *a, **kw)
        weight = engine.runner.model.model.layers[1].self_attn.o_proj.weight
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
        return engine

    monkeypatch.setattr(metrale.startup, "build_llm_engine", build_and_perturb)
    status = main(["circuit", "diff", "--model", checkpoint_factory("llama"), "--dtype", "float32",
                   "--device", "cpu", *CLI_PROMPT])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "first divergence: layers.1.self_attn (request 0" in out
    marked = [line.split()[0] for line in out.splitlines() if line.endswith("<- past tolerance")]
    assert marked[0] == "layers.1.self_attn"
    assert "layers.0.mlp" not in marked


def test_json_report_parses(checkpoint_factory, capsys):
    status = main(["circuit", "diff", "--model", checkpoint_factory("llama"), "--dtype", "float32",
                   "--device", "cpu", "--max-num-batched-tokens", str(STEP_BUDGET), "--json", *CLI_PROMPT])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["exit_status"] == 0
    assert report["first_divergence"] is None
    assert report["architecture"] == "LlamaForCausalLM" and report["tp_size"] == 1
    assert report["prompt_lens"][1] == len(PROMPTS[1])
    assert report["tolerance"] == {"max_rel": 1e-4, "min_cosine": 0.99999, "source": "float32 defaults"}
    names = [tap["name"] for tap in report["taps"]]
    assert names == ["embed", "layers.0.self_attn", "layers.0.mlp", "layers.1.self_attn", "layers.1.mlp",
                     "norm", "logits"]
    for tap in report["taps"]:
        assert tap["within_tolerance"] is True
        assert set(tap) >= {"max_abs", "max_rel", "cosine", "worst_request", "worst_token", "requests"}
        assert len(tap["requests"]) == 2
        assert set(tap["requests"][0]) == {"max_abs", "max_rel", "cosine", "worst_token"}
    assert report["taps"][-1]["requests"][1]["worst_token"] == len(PROMPTS[1]) - 1  # logits: the last token


def test_tensor_parallel_two_ranks(checkpoint_factory, capsys):
    """tp=2 on the CPU (gloo): rank 0's taps, taken after each reduction, match transformers'."""
    status = main(["circuit", "diff", "--model", checkpoint_factory("qwen3"), "--dtype", "float32",
                   "--device", "cpu", "--tp-size", "2", "--master-port", str(free_port()), "--json", *CLI_PROMPT])
    report = json.loads(capsys.readouterr().out)
    assert report["tp_size"] == 2
    assert status == 0, report["summary"]
    assert len(report["taps"]) == 7


def test_unusable_input_exits_2(checkpoint_factory, capsys):
    status = main(["circuit", "diff", "--model", checkpoint_factory("llama"), "--device", "cpu",
                   "--prompt-token-ids", "1,2,100000"])
    assert status == 2
    assert "error:" in capsys.readouterr().err


def test_measures():
    ref = torch.tensor([[1.0, -2.0, 0.0], [0.0, 0.0, 0.0]])
    same = TapDiff.of(ref, ref.clone())
    assert (same.max_abs, same.max_rel) == (0.0, 0.0) and same.cosine == pytest.approx(1.0)
    off = TapDiff.of(ref + torch.tensor([[0.0, 0.2, 0.0], [0.0, 0.0, 0.0]]), ref)
    assert off.max_abs == pytest.approx(0.2) and off.max_rel == pytest.approx(0.1) and off.worst_token == 0
    assert TapDiff.of(ref, ref + torch.tensor([[0.0], [0.5]]), first_position=4).worst_token == 5
    assert off.cosine < 1.0 and not off.within(Tolerance(1e-4, 0.99999))
    assert Tolerance.for_dtype("bfloat16").max_rel > Tolerance.for_dtype("float32").max_rel
    assert Tolerance.for_dtype("float32", max_rel=0.5) == Tolerance(0.5, 0.99999)


def test_fp8_checkpoint_compares_on_its_dequantized_weights(tmp_path, capsys):
    """A block-FP8 checkpoint: transformers runs the dequantized weights (its own FP8 loader needs a
    GPU). Without activation quantization every tap agrees; with it (the default) the first layer
    already differs by more than the float32 tolerance, and a note says why."""
    from fp8_checkpoints import quantize_checkpoint

    src = make_checkpoint(str(tmp_path / "src"), "qwen3", hidden_size=80, intermediate_size=144)
    fp8, _ = quantize_checkpoint(src, str(tmp_path / "fp8"), str(tmp_path / "ref"), (32, 32))
    args = ["circuit", "diff", "--model", fp8, "--dtype", "float32", "--device", "cpu", *CLI_PROMPT]
    assert main(args + ["--activation-quantization", "none"]) == 0
    assert "all 7 taps within tolerance" in capsys.readouterr().out
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert "first divergence: layers.0.self_attn" in out and "activation quantization" in err
