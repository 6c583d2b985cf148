"""What `met` refuses at startup, in one line naming the cause (issue 22): corrupt or truncated
checkpoints, checkpoints with their own modeling code, unknown model types, bad options. And a
warning for a KV pool too small for one full-length sequence."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from metrale.config.model_config import ModelLoadError, check_no_remote_code
from metrale.entrypoints.cli import main


@pytest.fixture
def checkpoint_copy(checkpoint_factory, tmp_path):
    source = checkpoint_factory("llama")
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def _edit_config(path, **fields):
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(fields)
    config_path.write_text(json.dumps(config))


def _generate(model, capsys) -> tuple[int, str]:
    code = main(["generate", "--model", str(model), "--device", "cpu", "--prompt", "hello", "--max-tokens", "2"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_checkpoint_is_one_line_naming_the_file(checkpoint_copy, capsys, damage):
    weights = checkpoint_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 64)
    code, err = _generate(checkpoint_copy, capsys)
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert str(weights) in err and "corrupt or truncated" in err


def test_checkpoint_with_its_own_modeling_code_is_refused(checkpoint_copy, capsys):
    _edit_config(checkpoint_copy, auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                            "AutoModelForCausalLM": "modeling_custom.CustomLlamaForCausalLM"})
    (checkpoint_copy / "modeling_custom.py").write_text("raise SystemExit('remote code ran')\n")
    code, err = _generate(checkpoint_copy, capsys)
    assert code == 1 and "Traceback" not in err
    assert "modeling_custom.CustomLlamaForCausalLM" in err and "never runs code" in err
    assert "trust_remote_code" not in err


def test_remote_code_for_the_architecture_met_implements_is_ignored():
    raw = {"auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}
    check_no_remote_code(raw, "DeepseekV3ForCausalLM", "ckpt")  # met runs its own: no error
    with pytest.raises(ModelLoadError):
        check_no_remote_code({"auto_map": {"AutoModel": "org/repo--modeling_x.Other"}}, "DeepseekV3ForCausalLM", "c")


def test_unknown_model_type_gives_no_advice_met_cannot_follow(checkpoint_copy, capsys):
    _edit_config(checkpoint_copy, model_type="llama_from_the_future")
    code, err = _generate(checkpoint_copy, capsys)
    assert code == 1 and "Traceback" not in err
    assert "llama_from_the_future" in err and "trust_remote_code" not in err


def test_bad_option_is_one_line(capsys):
    code = main(["generate", "--prompt", "x", "--max-num-seqs", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: max_num_seqs must be at least 1"), err


def test_kv_pool_smaller_than_one_sequence_warns(caplog):
    from metrale.entrypoints.llm import LLM
    from metrale.messages.sampling_params import SamplingParams

    with caplog.at_level("WARNING"):
        llm = LLM(model="demo", device="cpu", num_kv_blocks=1, enforce_eager=True)
    assert any("less than one full-length sequence" in r.message for r in caplog.records)
    out = llm.generate(["hello there"], SamplingParams(max_tokens=40), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"


def test_server_with_a_damaged_checkpoint_exits_1_with_one_error_line(checkpoint_copy):
    weights = checkpoint_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    proc = subprocess.run([sys.executable, "-m", "metrale.entrypoints.cli", "serve", "--model", str(checkpoint_copy),
                           "--device", "cpu", "--port", "0"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line and "corrupt or truncated" in line]
    assert len(errors) == 1 and str(weights) in errors[0], proc.stderr


def test_debug_shows_the_traceback(capsys):
    from metrale.config.errors import OptionError, show_tracebacks

    try:
        with pytest.raises(OptionError):
            main(["generate", "--prompt", "x", "--max-num-seqs", "0", "--debug"])
    finally:
        show_tracebacks(False)


def test_a_topology_the_model_cannot_take_is_one_line(checkpoint_factory, capsys):
    # 2 KV heads cannot be replicated over 3 ranks (nor split: fewer than the ranks): refused before any process starts
    path = checkpoint_factory("llama")
    capsys.readouterr()
    code = main(["generate", "--model", path, "--device", "cpu", "--prompt", "x", "--tensor-parallel-size", "3"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("error: LlamaForCausalLM: 2 KV heads cannot be replicated evenly over tp_size=3")


def test_unsupported_activation_is_refused(checkpoint_copy, capsys):
    _edit_config(checkpoint_copy, hidden_act="gelu_pytorch_tanh")
    code, err = _generate(checkpoint_copy, capsys)
    assert code == 1 and "Traceback" not in err
    assert "hidden_act 'gelu_pytorch_tanh' is not supported" in err


def test_vocabulary_padded_past_the_tokenizer_is_never_sampled(checkpoint_factory):
    import torch

    from metrale import LLM, SamplingParams

    path = checkpoint_factory("llama", vocab_size=512)  # the tokenizer holds 384 of them
    llm = LLM(path, device="cpu", dtype="float32")
    runner = llm.llm_engine.runner
    assert runner.sampled_vocab_size == 384 < llm.llm_engine.model_config.vocab_size
    with torch.no_grad():  # make the padded rows win every argmax, were they sampled
        runner.model.lm_head.weight[384:] = runner.model.lm_head.weight[:128] * 50
    outs = llm.generate(["Hello world", "The quick"], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                                        SamplingParams(temperature=1.0, seed=1, max_tokens=8,
                                                                       ignore_eos=True)], use_tqdm=False)
    assert all(t < 384 for o in outs for t in o.outputs[0].token_ids)
