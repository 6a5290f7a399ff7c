"""The weight formats' names, without torch: the command line lists them before it imports
anything heavy (:mod:`treeserve.ops.formats` implements them and re-exports these)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class WeightFormat(enum.Enum):
    """How the weights of a served model are stored; the value is the user-facing name."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    Q4_1 = "q4_1"
    GGUF = "gguf"

    @property
    def is_int(self) -> bool:
        """True for the formats of integer codes (CPU kernels only)."""
        return self in (WeightFormat.INT8, WeightFormat.Q4_1, WeightFormat.GGUF)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of activations, KV cache and embeddings under this format."""
        import torch

        return torch.float32 if self is WeightFormat.FLOAT32 else torch.bfloat16

    @classmethod
    def parse(cls, name: str | WeightFormat) -> WeightFormat:
        """The format called ``name``; ``ValueError`` lists the known names otherwise."""
        if isinstance(name, WeightFormat):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown weight format {name!r}; known: {', '.join(f.value for f in cls)}") from None


AUTO_FORMAT = "auto"
"""For a GGUF, the format it is stored in (``q4_1`` when its linears are Q4_1, else ``gguf``);
for float weights :data:`DEFAULT_FORMAT` where the model's shapes allow it, else bfloat16 (see
:func:`treeserve.ops.formats.resolve_format`); what ``serve`` and ``generate`` use unless told
otherwise."""

DEFAULT_FORMAT = WeightFormat.Q4_1
"""The fastest format whose greedy output agrees with float32 on at least 90% of tokens
(``bench/forward.py`` measures both; the figures are in ``bench/RESULTS.md``)."""

FORMAT_NAMES: tuple[str, ...] = (AUTO_FORMAT, *(f.value for f in WeightFormat))
"""The user-facing names, in the order the CLI lists them."""

__all__ = ["AUTO_FORMAT", "DEFAULT_FORMAT", "FORMAT_NAMES", "WeightFormat"]
