"""A tiny pre-LN residual stack for the progressive layer dropping tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.pld import SwitchableBlocks

WIDTH, DEPTH = 8, 4


class Block(nn.Module):
    """x + fc2(gelu(fc1(ln(x)))): the residual is inside the block, as in a transformer layer."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class PLDNet(nn.Module):
    """Takes DeepSpeed's PLD keyword arguments and records what it was given."""

    def __init__(self, seed: int = 0, depth: int = DEPTH):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = SwitchableBlocks([Block() for _ in range(depth)])
        self.out = nn.Linear(WIDTH, 1)
        self.seen: list[dict] = []

    def forward(self, x, y, **pld_kwargs):
        self.seen.append(dict(pld_kwargs))
        h = self.blocks(self.inp(x), pld_theta=pld_kwargs.get("pld_theta"))
        return F.mse_loss(self.out(h), y)


def batches(steps: int, rows: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, WIDTH, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(steps)]
