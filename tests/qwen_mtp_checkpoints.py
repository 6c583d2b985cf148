"""Tiny checkpoints with an MTP layer in the `mtp.*` layout (models/qwen_mtp.py), for the MTP
drafting tests: Qwen's published one on Qwen3-Next / Qwen3.5 (tests/models/test_mtp_qwen3_next.py,
tests/gpu/test_gpu_mtp.py; transformers writes the model, hybrid_checkpoints.py) and met's dense
one on Llama / Qwen3 (tests/models/test_mtp_dense.py, checkpoints.py). `write_mtp_layer` adds the
`mtp.*` tensors to the safetensors and the layer count to the config; `ReferenceMTP` is the MTP
forward in plain torch over transformers' own modules, for checking every draft.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import torch

from checkpoints import load_reference, reference_greedy
from hybrid_checkpoints import spec_prompts
from metrale import LLM, SamplingParams

LAYERS = 2  # layer 0 Gated DeltaNet, layer 1 gated attention (the MTP layer's source)
SOURCE = f"model.layers.{LAYERS - 1}."
# A dense family's layout (DENSE_LAYOUT): standard norms (scale w, so random ones centre on 1)
# and the count under num_nextn_predict_layers.
DENSE = dict(norm_centre=1.0, count_field="num_nextn_predict_layers")


def write_mtp_layer(base: str, path: str, passthrough: bool = False, norm_centre: float = 0.0,
                    count_field: str = "mtp_num_hidden_layers", **config_edits) -> dict:
    """A copy of `base` with an `mtp.*` layer: the full-attention layer's tensors (SOURCE: the
    last layer) times 1.5 as mtp.layers.0, a random fc and random norms around `norm_centre` (0
    for zero-centred norms, 1 for standard ones); or (`passthrough`) fc = [0 | I], the layer's
    o_proj and down projections zero and every norm's scale 1, so the layer's output is the
    trunk's hidden state renormalised and its draft is the target's own last token. The config
    gets `count_field: 1` (then `config_edits`). Returns the MTP tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    hidden = weights["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(3)
    mtp = {name.replace(SOURCE, "mtp.layers.0."): 1.5 * t for name, t in weights.items() if name.startswith(SOURCE)}
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.15
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = norm_centre + torch.randn(hidden, generator=g) * 0.3
    if passthrough:
        mtp["mtp.fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
        for name in mtp:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                mtp[name] = torch.zeros_like(mtp[name])
            elif name.endswith("norm.weight") and not name.endswith(("q_norm.weight", "k_norm.weight")):
                mtp[name] = torch.full_like(mtp[name], norm_centre)
    save_file({**weights, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, count_field: 1, **config_edits}, f)
    return mtp


def make_qwen_mtp_checkpoint(root: str, family: str, passthrough: bool = False) -> str:
    """`root`/base: transformers' tiny `family` checkpoint (LAYERS layers, the speculative tests'
    initializer range); `root`/with_mtp: it with an MTP layer (`write_mtp_layer`). -> the latter."""
    from hybrid_checkpoints import SPEC_INITIALIZER_RANGE, make_hybrid_checkpoint

    base = make_hybrid_checkpoint(os.path.join(root, "base"), family, num_hidden_layers=LAYERS,
                                  initializer_range=SPEC_INITIALIZER_RANGE)
    write_mtp_layer(base, os.path.join(root, "with_mtp"), passthrough=passthrough)
    return os.path.join(root, "with_mtp")


class ReferenceMTP:
    """The `mtp.*` MTP forward in plain torch over transformers' trunk: fc and the three norms
    from the MTP tensors (copies of transformers' final norm of the family: zero-centred for the
    Qwen hybrids, standard for the dense families), the decoder layer = transformers' own
    (full-attention) layer of the family holding mtp.layers.0's tensors (the base checkpoint with
    its SOURCE layer replaced by them, loaded by transformers, that layer taken out); the head is
    the target's lm_head."""

    def __init__(self, base: str, mtp: dict, scratch: str):
        from safetensors.torch import load_file, save_file

        self.model = load_reference(base)
        self.model.config._attn_implementation = "eager"
        shutil.copytree(base, scratch)
        weights = load_file(os.path.join(scratch, "model.safetensors"))
        for name in [n for n in weights if n.startswith(SOURCE)]:
            weights[name] = mtp[name.replace(SOURCE, "mtp.layers.0.")]
        save_file(weights, os.path.join(scratch, "model.safetensors"), metadata={"format": "pt"})
        holder = load_reference(scratch)
        holder.config._attn_implementation = "eager"
        self.block = holder.model.layers[LAYERS - 1]
        self.norms = {}
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[norm] = copy.deepcopy(self.model.model.norm)  # the family's RMSNorm
            self.norms[norm].weight.data = mtp[f"mtp.{norm}.weight"]
        self.fc = mtp["mtp.fc.weight"]

    @torch.no_grad()
    def trunk(self, sequence: list[int]) -> torch.Tensor:
        """transformers' final hidden states over a whole sequence: causal, so row p is also that of
        every prefix longer than p (one trunk pass per request, not per step)."""
        return self.model.model(torch.tensor([sequence])).last_hidden_state[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int, trunk: torch.Tensor) -> list[int]:
        """The k chained drafts after `tokens` (the last one just sampled); `trunk`: `self.trunk`
        of a sequence that starts with `tokens`."""
        inputs = [self._input(trunk[p], tokens[p + 1]) for p in range(len(tokens) - 1)]
        drafts = []
        for _ in range(k):
            hidden = self.norms["norm"](self._block(torch.stack(inputs))[-1])
            drafts.append(int(self.model.lm_head(hidden).argmax()))
            inputs.append(self._input(hidden, drafts[-1]))
        return drafts

    def _input(self, hidden: torch.Tensor, token: int) -> torch.Tensor:
        embedding = self.model.model.embed_tokens.weight[token]
        x = torch.cat([self.norms["pre_fc_norm_embedding"](embedding), self.norms["pre_fc_norm_hidden"](hidden)])
        return x @ self.fc.T

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        embeddings = self.model.model.rotary_emb(x[None], positions)
        return self.block(x[None], position_embeddings=embeddings, attention_mask=mask, position_ids=positions)[0]


def assert_drafts_equal_reference(make_llm, reference: ReferenceMTP, prompts: list[list[int]], params, k: int,
                                  monkeypatch) -> int:
    """Generates `prompts` with the engine `make_llm()` builds, recording every draft its MTP
    drafter proposes, and asserts each equals `reference`'s for the request's tokens then (over
    the finished sequence's trunk). Returns how many proposals were checked."""
    from metrale.executor.drafters.mtp import MTPDrafter

    proposals = []  # (request id, its tokens then, drafts)
    propose = MTPDrafter.propose

    def recording(self, inputs):
        out = propose(self, inputs)
        requests = llm.llm_engine.runner.requests
        for rid, accepted, row in zip(inputs.request_ids, inputs.num_accepted.tolist(), out.token_ids.tolist()):
            proposals.append((rid, len(requests[rid].token_ids) + accepted, row))
        return out

    monkeypatch.setattr(MTPDrafter, "propose", recording)
    llm = make_llm()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sequences = {o.request_id: p + o.outputs[0].token_ids for o, p in zip(outputs, prompts)}
    trunks = {rid: reference.trunk(sequence) for rid, sequence in sequences.items()}
    checked = 0
    for rid, num_tokens, drafts in proposals:
        if num_tokens > len(sequences[rid]):
            continue  # the request ended at this step: no later step reads its drafts
        assert drafts == reference.drafts(sequences[rid][:num_tokens], k, trunks[rid]), (rid, num_tokens)
        checked += 1
    return checked


# -- shared by the MTP drafting tests (test_mtp_qwen3_next.py, test_mtp_dense.py) -----------------

MTP_NEW_TOKENS = 12
MTP_GREEDY = SamplingParams(temperature=0, max_tokens=MTP_NEW_TOKENS, ignore_eos=True)


def mtp_checkpoint_cache(tmp_path_factory, tag: str, make_base, **layer_kwargs):
    """family -> (base, with MTP, the MTP tensors, transformers' greedy tokens on spec_prompts()),
    each family built once: `make_base(path, family)` writes the base checkpoint, `layer_kwargs`
    go to write_mtp_layer."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"{tag}_{family}")
            base = make_base(str(root / "base"), family)
            mtp = write_mtp_layer(base, str(root / "with_mtp"), **layer_kwargs)
            reference = load_reference(base)
            expected = [reference_greedy(reference, p, MTP_NEW_TOKENS) for p in spec_prompts()]
            cache[family] = base, str(root / "with_mtp"), mtp, expected
        return cache[family]

    return get


def mtp_engine(path: str, k: int | None = 1, **kwargs) -> LLM:
    spec = {"method": "mtp"} if k is None else {"method": "mtp", "num_speculative_tokens": k}
    return LLM(path, dtype="float32", device="cpu", speculative_config=spec, **kwargs)


def greedy(llm: LLM, prompts=None) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in (prompts or spec_prompts())]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, MTP_GREEDY, use_tqdm=False)]


def assert_drafted_and_idle(llm: LLM) -> None:
    """Drafts were proposed, and every block (and state slot, where the model keeps state) is free again."""
    scheduler = llm.llm_engine.scheduler
    assert scheduler.spec_stats.num_drafts > 0, scheduler.spec_stats
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    if llm.llm_engine.runner.layout.has_state:
        assert scheduler.kv.num_free_state_slots == scheduler.max_num_seqs
