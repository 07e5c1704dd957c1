"""An embedding model on the native engine: a decoder without its lm_head.

Embedding checkpoints such as Qwen3-Embedding are saved as the bare decoder (`Qwen3Model`:
`embed_tokens.weight`, `layers.N....`, `norm.weight`, no `model.` prefix and no lm_head).
They load into the causal LM's module tree with the prefix added; the lm_head is left out
(never allocated, never read), as is any `lm_head.weight` a causal checkpoint carries.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

_BARE_DECODER = ("embed_tokens.", "layers.", "norm.")


def drop_lm_head(model: nn.Module) -> None:
    """Remove the lm_head (before the model is materialized: it takes no memory)."""
    model.lm_head = None


def decoder_tensors(tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors under the causal LM's names, the lm_head's left out."""
    for name, tensor in tensors:
        if name.startswith("lm_head."):
            continue
        yield (f"model.{name}" if name.startswith(_BARE_DECODER) else name), tensor
