"""``set_random_seed``: seed every generator a training script draws from (DeepSpeed's
``runtime.utils.set_random_seed``, which re-exports it)."""

from __future__ import annotations

import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (when NumPy is installed) and torch
    (CPU and every CUDA device), as DeepSpeed's ``runtime.utils.set_random_seed`` does.

    NumPy takes ``seed mod 2**32`` and torch ``seed mod 2**63``, so any integer is accepted."""
    import random

    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)
