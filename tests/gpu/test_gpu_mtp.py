"""On the GPU: MTP drafting on the hybrid families, Qwen3-Next and Qwen3.5, in float32 on the
Triton backends (the MTP layer's attention on the Triton attention backend, the target's Gated
DeltaNet state kept per draft by the Triton verify kernel), and on the dense families (met's own
`mtp.*` layout on Llama / Qwen3), whose target steps replay the decode and verify graphs and hand
the graphs' hidden states to the drafter (the drafter's own passes run eagerly). With a
"passthrough" MTP layer (tests/qwen_mtp_checkpoints.py: it drafts the target's own
last token) drafts are both accepted and rejected, and greedy tokens with MTP drafting equal plain
decoding's, graphs off and on. (transformers' tokens and the drafts against a reference are
checked on the CPU: tests/models/test_mtp_qwen3_next.py.)

The checkpoints need transformers' Qwen3-Next / Qwen3.5 classes to be written; where the GPU
machine's transformers lacks them, the test fails saying so.
"""

from __future__ import annotations

import pytest
import transformers

from checkpoints import make_checkpoint
from hybrid_checkpoints import HYBRID_FAMILIES, SPEC_INITIALIZER_RANGE
from metrale import LLM, SamplingParams
from qwen_mtp_checkpoints import DENSE, make_qwen_mtp_checkpoint, write_mtp_layer

pytestmark = pytest.mark.gpu
FAMILIES = ["qwen3_next", "qwen3_5"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
REPETITIVE = [5] * 8  # the CPU test's Qwen3-Next checkpoint answers it with one token nine times


def prompts() -> list[list[int]]:
    from hybrid_checkpoints import spec_prompts

    return spec_prompts() + [REPETITIVE]


def run(path, speculative=True, **kw):
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}} if speculative else {}
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=16, **spec, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_drafting_equals_plain_decoding(family, tmp_path):
    if not hasattr(transformers, HYBRID_FAMILIES[family][1]):
        pytest.fail(f"transformers {transformers.__version__} has no {HYBRID_FAMILIES[family][1]}")
    path = make_qwen_mtp_checkpoint(str(tmp_path), family, passthrough=True)
    _, plain = run(path, speculative=False, enforce_eager=True)
    for eager in (True, False):
        llm, drafted = run(path, enforce_eager=eager)
        assert drafted == plain, f"enforce_eager={eager}"
        stats = llm.llm_engine.scheduler.spec_stats
        assert stats.num_drafts > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats
        if family == "qwen3_next":
            assert stats.num_accepted_tokens > 0, stats


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dense_mtp_target_steps_replay_graphs(family, tmp_path):
    base = make_checkpoint(str(tmp_path / "base"), family, num_hidden_layers=2,
                           initializer_range=SPEC_INITIALIZER_RANGE)
    path = str(tmp_path / "with_mtp")
    write_mtp_layer(base, path, passthrough=True, **DENSE)
    _, plain = run(path, speculative=False, enforce_eager=True)
    _, eager = run(path, enforce_eager=True, attention_backend="triton")
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=16, attention_backend="triton",
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    runner, replays = llm.llm_engine.runner, []
    for graphs in (runner.graphs, runner.verify_graphs):
        graphs.run = (lambda inner: lambda *a: replays.append(1) or inner(*a))(graphs.run)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    graphed = [o.outputs[0].token_ids for o in outs]
    assert graphed == eager == plain
    assert replays, "no target step replayed a graph"
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_async_scheduling_plans_verify_steps_over_drafts_on_the_device(family, tmp_path):
    """With asynchronous scheduling (the default on CUDA), a greedy request is planned over its
    verify step in flight with the drafts the MTP layer left on the device; its rows move back on
    the device by the drafts rejected. The tokens equal the synchronous engine's; the dense
    target's verify graphs take such steps from the device."""
    if family == "qwen3_next":
        if not hasattr(transformers, HYBRID_FAMILIES[family][1]):
            pytest.fail(f"transformers {transformers.__version__} has no {HYBRID_FAMILIES[family][1]}")
        path = make_qwen_mtp_checkpoint(str(tmp_path), family, passthrough=True)
    else:
        base = make_checkpoint(str(tmp_path / "base"), family, num_hidden_layers=2,
                               initializer_range=SPEC_INITIALIZER_RANGE)
        path = str(tmp_path / "with_mtp")
        write_mtp_layer(base, path, passthrough=True, **DENSE)
    _, synchronous = run(path, async_scheduling=False)
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=16,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    engine = llm.llm_engine
    assert engine.async_scheduling and engine.scheduler.drafts_on_device
    overlapped, from_device, schedule = [0], [], engine.scheduler.schedule

    def counting():
        plan, ended = schedule()
        overlapped[0] += sum(1 for c in plan.cached_requests if c.num_unverified_drafts)
        return plan, ended

    engine.scheduler.schedule = counting
    graphs = engine.runner.verify_graphs
    if graphs is not None:
        for g in graphs.by_rows.values():
            g._copy_from_device = (lambda inner: lambda *a: from_device.append(1) or inner(*a))(g._copy_from_device)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == synchronous
    assert overlapped[0] > 0
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0
    if family == "qwen3":
        assert from_device, "no verify step planned over drafts in flight replayed a graph"
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_sampled_requests_planned_over_drafts_draw_the_same_alone_and_batched(tmp_path):
    """Seeded sampled requests are planned over their verify step in flight too: their output
    index is corrected on the device (BatchInputs.index_shift) and their stream keys hashed there
    (the Triton rejection kernel and sampler), so each draws the same tokens alone as batched.
    (Not the synchronous engine's tokens: tests/models/test_async_speculation.py says why.)"""
    base = make_checkpoint(str(tmp_path / "base"), "qwen3", num_hidden_layers=2, initializer_range=SPEC_INITIALIZER_RANGE)
    path = str(tmp_path / "with_mtp")
    write_mtp_layer(base, path, passthrough=True, **DENSE)
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=7 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts()))]
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=16,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    engine, overlapped, schedule = llm.llm_engine, [0], llm.llm_engine.scheduler.schedule
    assert engine.async_scheduling and engine.scheduler.drafts_on_device

    def counting():
        plan, ended = schedule()
        overlapped[0] += sum(1 for c in plan.cached_requests if c.num_unverified_drafts)
        return plan, ended

    engine.scheduler.schedule = counting
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], params,
                                                            use_tqdm=False)]
    assert overlapped[0] > 0 and engine.scheduler.spec_stats.num_accepted_tokens > 0
    alone = [llm.generate([{"prompt_token_ids": p}], [q], use_tqdm=False)[0].outputs[0].token_ids
             for p, q in zip(prompts(), params)]
    assert alone == batched
