"""A group's wire format for gathers and reduce-scatters (``Collectives.codec``).

Without a codec (the default) a collective's payload travels as it is. With one, each rank
encodes what it sends (``encode``: a 1-D tensor, the same size on every rank for the same input
size), the payloads travel, and each rank decodes every payload it received (its own
included, so every rank holds the same values):

- all-gather: this rank's shard is encoded once; the gathered payloads are decoded into the
  output's slices;
- reduce-scatter (sum): each peer's rows are encoded and sent to it (an all-to-all of payloads);
  the payloads received are decoded and summed into this rank's slice.

The comms logger and the byte counters see the payload bytes: what travelled. All-reduces,
broadcasts and all-to-alls carry their tensors unchanged.
"""

from __future__ import annotations

import torch


class Codec:
    """The interface: ``encode(values) -> payload`` and ``decode(payload, out)``."""

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.encode")

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__}.decode")


class CastCodec(Codec):
    """Sends values cast to ``dtype`` (e.g. ``torch.bfloat16``) and casts them back on arrival."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return values.reshape(-1).to(self.dtype)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload.view(out.shape))


__all__ = ["Codec", "CastCodec"]
