"""``SwitchableBlocks``: a stack of transformer blocks that progressive layer dropping can skip.

The paper's switchable-transformer gate over depth: while training with theta < 1, block ``l``
of ``L`` (counted from 1) runs with probability p_l = 1 - (l / L) * (1 - theta) and, when it
runs, its residual branch is scaled by 1 / p_l (inverted dropout, so evaluation runs every block
unscaled). The last block is kept with probability theta, the first almost always.

Every rank draws the same decisions: the random numbers come from a generator seeded with a
value all ranks share (the engine's micro-step when the engine has bound the stack, else the
stack's own count of training passes), never from the per-rank RNG. A dropped block's forward is
not called, so ZeRO stage 3 does not gather its parameters; nor does it prefetch them: before
each training forward the engine draws the same decisions (they depend on the micro-step only)
and tells stage 3's parameter coordinator which blocks sit the pass out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

_MIX = 1_000_003  # mixes (seed, stack index, step) into one generator seed


def keep_probabilities(theta: float, num_layers: int) -> list[float]:
    """p_l = 1 - (l / L) * (1 - theta) for l = 1..L (the paper's stochastic-depth rule)."""
    return [1.0 - (layer / num_layers) * (1.0 - float(theta)) for layer in range(1, num_layers + 1)]


class SwitchableBlocks(nn.ModuleList):
    """``nn.ModuleList`` of blocks, each mapping hidden states to hidden states (or a tuple whose
    first element is them, as Hugging Face layers return), run in order by ``forward``.

    ``forward(hidden, *args, pld_theta=None, progressive_layer_drop=None, **kwargs)`` passes
    ``args``/``kwargs`` to every block and returns the last hidden states. Pass the engine's
    ``pld_theta`` through (the model's forward receives it while training); without it, in
    eval mode, or at theta 1.0 every block runs, exactly as a plain loop would. State-dict
    keys are those of the ``nn.ModuleList`` (``<name>.<i>.<param>``).

    ``seed`` separates stacks that should drop independently; the engine also gives each stack
    of a model its own index when it binds them (``bind``)."""

    def __init__(self, blocks: Iterable[nn.Module] = (), seed: int = 0):
        super().__init__(blocks)
        self.seed = int(seed)
        self.index = 0
        self.training_passes = 0  # the shared value when no engine bound a step source
        self.last_kept: list[bool] | None = None  # the decisions of the last training pass
        self._step_source: Callable[[], int] | None = None

    def bind(self, step_source: Callable[[], int], index: int = 0) -> None:
        """Draw from ``step_source()``: a value every rank shares (the engine's micro-step, which
        a resumed run restores and a recomputation in backward sees unchanged). ``index``
        separates the stacks of one model. The engine calls this at initialize."""
        self._step_source = step_source
        self.index = int(index)

    def draw(self, theta: float) -> list[bool]:
        """Which blocks run in this pass at keep ratio ``theta`` (the same list on every rank)."""
        step = self._step_source() if self._step_source is not None else self.training_passes
        generator = torch.Generator(device="cpu")
        generator.manual_seed(((self.seed * _MIX + self.index) * _MIX + int(step)) % (1 << 63))
        draws = torch.rand(len(self), generator=generator, dtype=torch.float64).tolist()
        return [u < p for u, p in zip(draws, keep_probabilities(theta, len(self)))]

    def forward(self, hidden, *args, pld_theta=None, progressive_layer_drop=None, **kwargs):
        dropping = self.training and pld_theta is not None and float(pld_theta) < 1.0
        if self.training:
            kept = self.draw(float(pld_theta)) if dropping else [True] * len(self)
            self.training_passes += 1
            self.last_kept = kept
        if not dropping:
            for block in self:
                hidden = _first(block(hidden, *args, **kwargs))
            return hidden
        probabilities = keep_probabilities(float(pld_theta), len(self))
        for block, keep, p in zip(self, kept, probabilities):
            if not keep:
                continue  # never called: stage 3's pre-forward hook does not gather it
            out = _first(block(hidden, *args, **kwargs))
            hidden = hidden + (out - hidden) / p  # the residual branch, scaled by 1 / p
        return hidden


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out
