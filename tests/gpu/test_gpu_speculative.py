"""On the GPU: speculative decoding's verify steps in CUDA graphs (executor/cuda_graphs.py) and the
Triton rejection sampler (kernels/rejection_sampling.py).

- Tiny Llama, Qwen3 and DeepSeek-V3 (MLA) in float32 with n-gram drafts: the tokens with verify
  graphs equal eager verify steps', plain decoding's and (Llama, Qwen3) transformers'; the verify
  graphs were replayed and drafts were accepted.
- The multi-query split-KV decode at Qwen3-8B's head shapes in bf16 against the reference.
- The rejection kernel against the PyTorch reference on the GPU at a 152k vocabulary: greedy
  identical; seeded sampling identical but for floating-point near-ties (the kernel's exp / log
  and sums are not torch's to the last bit on the GPU), so at most a few requests in 256 differ.
"""

import random

import pytest
import torch

from checkpoints import load_reference, reference_greedy
from metrale import LLM, SamplingParams
from mla_checkpoints import make_mla_checkpoint

pytestmark = pytest.mark.gpu

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
NEW_TOKENS = 24


def prompts():
    rng = random.Random(0)
    rand = [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 9, 40, 70, 181)]
    return rand + [[5, 6, 7, 8, 9] * 6, [20, 21, 22] * 15 + [23]]


def generate(path, **kw):
    # Verify graphs hold up to max_num_seqs sequences, within cuda_graphs.verify_row_limit rows (at
    # least 512 here): at 8, all 7 prompts drafting 3 tokens (28 rows) fit one. (When the rows were
    # capped at max_num_seqs, graphs at 16 held 4 sequences of 4 rows, and the tiny DeepSeek-V3's
    # steps, under asynchronous scheduling, always had a sequence with 3 drafts: none replayed.)
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=512, max_num_seqs=8, **kw)
    replays = []
    if llm.llm_engine.runner.verify_graphs is not None:
        graphs = llm.llm_engine.runner.verify_graphs
        run = graphs.run
        graphs.run = lambda *a: replays.append(1) or run(*a)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs], len(replays)


def check_family(path, expected=None):
    llm, graphs, replays = generate(path, attention_backend="triton", speculative_config=SPEC)
    runner = llm.llm_engine.runner
    assert runner.verify_graphs is not None and runner.verify_graphs.query_len == 1 + SPEC["num_speculative_tokens"]
    assert replays > 0
    if expected is not None:  # the dense families accept drafts on these prompts (as on the CPU)
        assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    _, eager, _ = generate(path, attention_backend="triton", speculative_config=SPEC, enforce_eager=True)
    _, plain, _ = generate(path, attention_backend="triton")
    assert graphs == eager == plain
    if expected is not None:
        assert graphs == expected


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_verify_graphs_give_plain_and_transformers_tokens(family, checkpoint_factory):
    path = checkpoint_factory(family)
    model = load_reference(path)
    check_family(path, [reference_greedy(model, p, NEW_TOKENS) for p in prompts()])


def test_verify_graphs_on_mla_give_plain_tokens(tmp_path):
    check_family(make_mla_checkpoint(str(tmp_path), "deepseek_v3"))


def test_multi_query_decode_at_qwen3_8b_shapes():
    import math

    from metrale.kernels import reference
    from metrale.kernels.paged_attention import decode_attention_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    num_queries, heads, kv_heads, dim, bs = 5, 32, 8, 128, 16
    query_lens = [5, 3, 1, 5]
    prefixes = [1000, 37, 4000, 0]
    seq_lens = [p + q for p, q in zip(prefixes, query_lens)]
    blocks = [-(-n // bs) for n in seq_lens]
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    perm = torch.randperm(sum(blocks), device="cuda", generator=g).to(torch.int32)
    for i, start in enumerate([sum(blocks[:i]) for i in range(len(blocks))]):
        tables[i, :blocks[i]] = perm[start:start + blocks[i]]
    k_cache = torch.randn(sum(blocks), bs, kv_heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(len(seq_lens) * num_queries, heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    real = [s * num_queries + t for s, n in enumerate(query_lens) for t in range(n)]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = decode_attention_triton(q, k_cache, v_cache, tables, lens, 1 / math.sqrt(dim), num_queries=num_queries,
                                  query_lens=torch.tensor(query_lens, dtype=torch.int32, device="cuda"))
    cu = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    expected = reference.extend_attention(q[real], k_cache, v_cache, tables, cu, lens, num_queries, 1 / math.sqrt(dim))
    torch.testing.assert_close(out[real], expected, rtol=2e-2, atol=2e-2)


def test_rejection_kernel_matches_the_reference_at_a_real_vocabulary():
    from metrale.executor.rejection_sampler import verify_drafts_reference, verify_drafts_triton
    from metrale.executor.sampler import SamplingRow

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, batch, k = 151936, 256, 4
    logits = torch.randn(batch * (k + 1), vocab, device="cuda", generator=g) * 2
    hot = torch.randint(0, vocab, (batch * (k + 1),), device="cuda", generator=g)
    logits[torch.arange(batch * (k + 1), device="cuda"), hot] += 9.0
    drafts = hot.view(batch, k + 1)[:, :k].tolist()
    for params, most_differ in ((SamplingParams(temperature=0), 0),
                                (SamplingParams(temperature=0.8, top_p=0.95), 4)):
        rows = [SamplingRow(params, 7 * i, [1, 2, 3], 2) for i in range(batch)]
        got = verify_drafts_triton(logits.clone(), rows, drafts)
        want = verify_drafts_reference(logits.clone(), rows, drafts)
        differ = int(((got[0] != want[0]) | (got[1] != want[1])).sum())
        assert differ <= most_differ, (params, differ)
        assert 0 < float(want[0].float().mean()) < k  # chains both accepted and cut
