"""What a step hands a vision-language model besides its token ids: the encoder outputs that take
the place of the placeholder tokens' embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MultiModalBatch:
    """`embeds` [N, D]: one row per True entry of `is_multimodal` [T] (bool), in token order; the
    rows replace the token embeddings there. D is the model's `embed_multimodal` width: the text
    hidden size, or for DeepStack models (Qwen3-VL) hidden * (1 + number of DeepStack layers),
    main embedding first."""

    embeds: torch.Tensor
    is_multimodal: torch.Tensor

    def check(self, num_tokens: int, width: int) -> None:
        if self.is_multimodal.shape != (num_tokens,) or self.is_multimodal.dtype != torch.bool:
            raise ValueError(f"is_multimodal must be bool [{num_tokens}], not {self.is_multimodal.dtype} "
                             f"{list(self.is_multimodal.shape)}")
        rows = int(self.is_multimodal.sum())
        if self.embeds.dim() != 2 or self.embeds.shape[0] != rows or self.embeds.shape[1] != width:
            raise ValueError(f"multimodal embeds {list(self.embeds.shape)} do not match {rows} placeholder "
                             f"token(s) of width {width}")
