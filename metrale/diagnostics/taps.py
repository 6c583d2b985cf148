"""Tap points of the residual stream, recorded from met's forward and from transformers'.

A tap is a value of the forward pass, not a module's output. met's decoder layers hand
(hidden, residual) pairs on and the next norm fuses the add, so the residual stream after a
block exists only inside that norm; transformers adds it in the decoder layer. The taps, in
forward order:

    embed              the token embeddings
    layers.i.<mixer>   the residual stream after layer i's token mixer (self_attn, linear_attn)
    layers.i.mlp       the residual stream after layer i's MLP (dense or mixture of experts)
    norm               the final norm's output
    logits             the LM head's logits at each request's last prompt token (the row met
                       samples from; met computes no other)

Both sides are recorded with forward hooks that live only inside `installed()`: the model code
knows nothing of them and pays nothing when none is installed. met's side works for every model
built on the shared trunk (models/common.py: DecoderModel of DecoderLayer), whatever its token
mixers and MLPs, so hybrid and MoE families need nothing of their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from metrale.layers.forward_context import get_forward_context
from metrale.models.common import DecoderLayer, DecoderModel

EMBED, FINAL_NORM, LOGITS = "embed", "norm", "logits"


class TapError(Exception):
    """A model whose taps cannot be placed: not on the shared trunk, or a reference whose layers
    do not line up with met's."""


def tap_names(mixer_names: Iterable[str]) -> list[str]:
    """Every tap in forward order, for layers whose token mixers have these checkpoint names."""
    names = [EMBED]
    for i, mixer in enumerate(mixer_names):
        names += [f"layers.{i}.{mixer}", f"layers.{i}.mlp"]
    return names + [FINAL_NORM, LOGITS]


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _host(value: torch.Tensor) -> torch.Tensor:
    # A copy at once: on the GPU the fused norms may write their inputs in place later.
    return value.detach().to("cpu", torch.float32, copy=True)


class MetTaps:
    """Records met's taps from the forward passes of one engine's steps, per request.

    Each step's rows are split by the step's layout: sequence i of the plan owns query rows
    query_start_loc[i]..[i+1], which are the last query_len_i positions of its seq_lens[i]. So a
    prompt prefilled in chunks, or beside other requests, comes back as one [tokens, ...] tensor
    per tap. `begin_step` must be told each plan's request order (the runner's row order).

    Under tensor parallelism this records on rank 0 only, and that is enough: every tap is taken
    after its reduction (the embedding's all-reduce, o_proj / out_proj / down_proj and the MoE
    output reduced before the next norm, the LM head's all-gather), so each rank holds the full
    values. The worker ranks run the same forward without hooks.
    """

    def __init__(self, model: nn.Module, prompt_lens: dict[str, int]):
        decoder = getattr(model, "model", None)
        if not isinstance(decoder, DecoderModel) or not all(isinstance(layer, DecoderLayer)
                                                            for layer in decoder.layers):
            raise TapError(f"{type(model).__name__} is not built on the shared trunk (models/common.py: "
                            "DecoderModel of DecoderLayer); its taps are unknown")
        self.model, self.decoder = model, decoder
        self.mixer_names = [layer.mixer_name for layer in decoder.layers]
        self.names = tap_names(self.mixer_names)
        self.prompt_lens = dict(prompt_lens)
        self._order: list[str] = []
        self._sequences: list[tuple[str, int, int, int]] = []
        # request id -> tap -> (first position, rows) pieces, in the order they were computed
        self._pieces: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {rid: {} for rid in prompt_lens}

    def begin_step(self, request_ids: Iterable[str]) -> None:
        self._order = list(request_ids)

    @contextlib.contextmanager
    def installed(self) -> Iterator["MetTaps"]:
        decoder, model = self.decoder, self.model
        handles = [decoder.register_forward_pre_hook(lambda m, a: self._start_forward()),
                   decoder.embed_tokens.register_forward_hook(lambda m, a, out: self._record(EMBED, out))]
        for i, layer in enumerate(decoder.layers):
            # post_attention_layernorm(mixer_out, residual) -> (normed, mixer_out + residual): its
            # second output is the residual stream after the token mixer.
            handles.append(layer.post_attention_layernorm.register_forward_hook(
                lambda m, a, out, name=f"layers.{i}.{layer.mixer_name}": self._record(name, out[1])))
            # A layer returns (mlp_out, residual); the next norm adds them.
            handles.append(layer.register_forward_hook(
                lambda m, a, out, name=f"layers.{i}.mlp": self._record(name, out[0] + out[1])))
        handles.append(decoder.norm.register_forward_hook(lambda m, a, out: self._record(FINAL_NORM, _first(out))))
        # compute_logits is a method, not a module call: shadowed on this instance while installed.
        compute_logits = model.compute_logits

        def recorded_logits(hidden: torch.Tensor) -> torch.Tensor:
            logits = compute_logits(hidden)
            self._record_sampled(logits)
            return logits

        model.compute_logits = recorded_logits
        try:
            yield self
        finally:
            del model.compute_logits
            for handle in handles:
                handle.remove()

    def _start_forward(self) -> None:
        """(request id, first row, first position, rows) of each sequence of the step, from its
        layout (kept for the logits, which the runner computes after the forward context ends)."""
        layout = get_forward_context().layout
        if len(self._order) != layout.num_seqs:
            raise RuntimeError(f"the step has {layout.num_seqs} sequences but its plan named {len(self._order)}")
        self._sequences, row = [], 0
        for rid, query_len, seq_len in zip(self._order, layout.query_lens_cpu, layout.seq_lens_cpu):
            self._sequences.append((rid, row, seq_len - query_len, query_len))
            row += query_len

    def _record(self, name: str, value: torch.Tensor) -> None:
        for rid, row, position, count in self._sequences:
            if rid in self._pieces:
                self._pieces[rid].setdefault(name, []).append((position, _host(value[row:row + count])))

    def _record_sampled(self, logits: torch.Tensor) -> None:
        # The runner computes logits for the sequences whose step reaches their last prompt token,
        # in plan order (a partial prefill chunk samples nothing).
        sampled = [rid for rid, _, position, count in self._sequences
                   if position + count == self.prompt_lens.get(rid, -1)]
        for index, rid in enumerate(sampled):
            self._pieces[rid].setdefault(LOGITS, []).append((self.prompt_lens[rid] - 1, _host(logits[index:index + 1])))

    def collect(self) -> dict[str, dict[str, torch.Tensor]]:
        """request id -> tap -> float32 [rows, ...] on the host: every prompt position, but one row
        (the last position) for the logits."""
        result = {}
        for rid, taps in self._pieces.items():
            result[rid] = {}
            for name in self.names:
                first = self.prompt_lens[rid] - 1 if name == LOGITS else 0
                pieces = sorted(taps.get(name, []), key=lambda piece: piece[0])
                positions = [q for start, rows in pieces for q in range(start, start + rows.shape[0])]
                if positions != list(range(first, self.prompt_lens[rid])):
                    raise RuntimeError(f"request {rid}: tap {name} saw positions {positions[:8]}..., not "
                                       f"{first}..{self.prompt_lens[rid] - 1} once each (a prefix-cache hit?)")
                result[rid][name] = torch.cat([rows for _, rows in pieces])
        return result


class ReferenceTaps:
    """The same taps from a transformers model (Llama-style: `get_decoder()` with embed_tokens,
    layers, norm; each layer's token mixer under met's checkpoint name of it), one prompt at a time.

    The residual after the mixer is the layer's input plus the mixer's output (a pre-hook keeps
    the input); the residual after the MLP is the layer's output.
    """

    def __init__(self, model: nn.Module, mixer_names: list[str]):
        self.model, self.decoder = model, model.get_decoder()
        self.names = tap_names(mixer_names)
        if len(self.decoder.layers) != len(mixer_names):
            raise TapError(f"transformers' model has {len(self.decoder.layers)} layers, met's {len(mixer_names)}")
        self.mixers = []
        for i, (layer, name) in enumerate(zip(self.decoder.layers, mixer_names)):
            mixer = getattr(layer, name, None)
            if not isinstance(mixer, nn.Module):
                raise TapError(f"transformers' layer {i} ({type(layer).__name__}) has no {name!r} module")
            self.mixers.append(mixer)
        self._values: dict[str, torch.Tensor] = {}
        self._layer_input: torch.Tensor | None = None

    def _hooks(self) -> list:
        def keep(name: str) -> Callable:
            return lambda m, a, out: self._keep(name, _first(out))

        def keep_input(module, args, kwargs):
            self._layer_input = args[0] if args else kwargs["hidden_states"]

        handles = [self.decoder.embed_tokens.register_forward_hook(keep(EMBED)),
                   self.decoder.norm.register_forward_hook(keep(FINAL_NORM))]
        for i, (layer, mixer) in enumerate(zip(self.decoder.layers, self.mixers)):
            mixer_tap = self.names[1 + 2 * i]
            handles.append(layer.register_forward_pre_hook(keep_input, with_kwargs=True))
            handles.append(mixer.register_forward_hook(
                lambda m, a, out, name=mixer_tap: self._keep(name, self._layer_input + _first(out))))
            handles.append(layer.register_forward_hook(keep(f"layers.{i}.mlp")))
        return handles

    def _keep(self, name: str, value: torch.Tensor) -> None:
        self._values[name] = _host(value[0])  # batch of one

    @torch.inference_mode()
    def run(self, token_ids: list[int]) -> dict[str, torch.Tensor]:
        """tap -> float32 [rows, ...] on the host, shaped as MetTaps.collect's."""
        self._values = {}
        handles = self._hooks()
        try:
            device = next(self.model.parameters()).device
            out = self.model(input_ids=torch.tensor([token_ids], device=device), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        self._values[LOGITS] = _host(out.logits[0, -1:])
        missing = [name for name in self.names if name not in self._values]
        if missing:
            raise RuntimeError(f"transformers' forward never reached the taps {missing}")
        return {name: self._values[name] for name in self.names}
