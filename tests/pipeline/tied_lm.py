"""The tied-embedding language model of the virtual-stage tests (test_engine_interleaved.py,
test_engine_vshape.py): one ``nn.Embedding`` used as the input layer, inside the stack (``mix``)
and as the output head (``head``), with a cross-entropy loss over the vocabulary."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH, SEQ, LR = 11, 8, 5, 0.2


def head(embedding, x):
    return x @ embedding.weight.t()


def mix(embedding, x):
    return torch.tanh(x @ embedding.weight.t()) @ embedding.weight


def lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def copies_differ(what, per_rank: list) -> list[str]:
    """The embedding's copies on the ranks holding it, after each step (``per_rank[rank][step]``),
    where they are not equal to the bit."""
    return [
        f"{what} step {step}: the embedding's copies differ"
        for step in range(len(per_rank[0]))
        if not all(torch.equal(r[step], per_rank[0][step]) for r in per_rank)
    ]
