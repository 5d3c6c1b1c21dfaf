"""Per-batch learning-rate schedules with DeepSpeed's names, parameters and semantics.

Every schedule here is stepped once per optimizer step and keeps a single counter,
``last_batch_iteration`` (-1 before the first ``step()``), which is also its whole
``state_dict``. This module holds the shared base class and the warmup family
(``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``); the cyclic schedules live in
``cycle_schedules``.
"""

import math

import torch
from torch.optim import Optimizer

from ..log import logger

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)


def unwrap_optimizer(optimizer):
    """Return ``optimizer`` if it is a torch Optimizer, else the one it wraps as ``.optimizer``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")


def per_group(optimizer, value, name):
    """Broadcast a scalar to every param group, or check a list has one value per group."""
    count = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"expected {count} values for {name} (one per param group), got {len(value)}")
        return list(value)
    return [value] * count


def group_lrs(optimizer):
    """The current lr of every param group, as floats."""
    return [float(group["lr"]) for group in optimizer.param_groups]


def apply_lrs(optimizer, lrs):
    """Write ``lrs`` into the optimizer's param groups and return them as a list."""
    for group, lr in zip(optimizer.param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            # In place, so fused/capturable optimizers that hold this tensor see the change.
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return list(lrs)


def check_positive_int(value, name):
    """Raise ValueError unless ``value`` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_warmup_type(warmup_type):
    """Return ``warmup_type`` if it is 'log' or 'linear', else raise ValueError."""
    # DeepSpeed logs a warning and falls back to 'log'; a typo should not change the schedule silently.
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {list(WARMUP_TYPES)}, got {warmup_type!r}")
    return warmup_type


def warmup_fraction(iteration, warmup_num_steps, warmup_type):
    """Share of the warmup done at ``iteration`` (0 <= iteration < warmup_num_steps)."""
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


def effective_warmup_steps(warmup_num_steps):
    """DeepSpeed's warmup length: at least 2, so the log warmup never divides by log(1)."""
    check_positive_int(warmup_num_steps, "warmup_num_steps")
    return max(2, warmup_num_steps)


class BatchLRScheduler:
    """Base of the DeepSpeed-style schedules.

    Subclasses implement :meth:`get_lr` for ``self.last_batch_iteration`` and call
    :meth:`_init_lr` at the end of their constructor.
    """

    def __init__(self, optimizer, last_batch_iteration=-1):
        self.optimizer = unwrap_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None

    def _init_lr(self):
        # As in DeepSpeed: only a fresh schedule (-1) writes its lr at construction. A resumed
        # one leaves the group lrs (restored with the optimizer state) alone until step().
        if self.last_batch_iteration == -1:
            self._last_lr = apply_lrs(self.optimizer, self.get_lr())

    def get_lr(self):
        """The lr of every param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self):
        """The lrs last written to the optimizer by this scheduler."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}: call step() before get_last_lr()")
        return list(self._last_lr)

    def step(self, last_batch_iteration=None):
        """Advance to ``last_batch_iteration`` (default: the next one) and apply its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = apply_lrs(self.optimizer, self.get_lr())

    def state_dict(self):
        """``{'last_batch_iteration': n}``, the same layout DeepSpeed checkpoints."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict):
        """Restore the counter; the lr follows at the next ``step()``."""
        self.last_batch_iteration = state_dict["last_batch_iteration"]


class WarmupLR(BatchLRScheduler):
    """Warm the lr of each group up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    Args:
        optimizer: the torch optimizer (or a wrapper exposing it as ``.optimizer``).
        warmup_min_lr (float or list): lr at iteration 0, per group if a list. Default 0.
        warmup_max_lr (float or list): lr after warmup. Default None: each group's current lr.
        warmup_num_steps (int): warmup length; values below 2 count as 2. Default 1000.
        warmup_type (str): 'log' (gamma = log(it+1)/log(n)) or 'linear' (gamma = it/n).
        last_batch_iteration (int): -1 to start fresh, else the iteration to resume after.
    """

    def __init__(
        self,
        optimizer,
        warmup_min_lr=0.0,
        warmup_max_lr=None,
        warmup_num_steps=1000,
        warmup_type=WARMUP_LOG_RATE,
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = effective_warmup_steps(warmup_num_steps)
        self.warmup_type = check_warmup_type(warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = group_lrs(self.optimizer)
        self.min_lrs = per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self._init_lr()

    def get_lr(self):
        """``min_lr + (max_lr - min_lr) * gamma`` for every group."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay to 0 at ``total_num_steps``.

    After warmup, gamma = max(0, (total_num_steps - it) / max(1, total_num_steps - warmup)).
    Unlike :class:`WarmupLR`, ``warmup_max_lr`` defaults to 0.001, as in DeepSpeed.
    """

    def __init__(
        self,
        optimizer,
        total_num_steps,
        warmup_min_lr=0.0,
        warmup_max_lr=0.001,
        warmup_num_steps=1000,
        warmup_type=WARMUP_LOG_RATE,
        last_batch_iteration=-1,
    ):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._get_gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(BatchLRScheduler):
    """Scale each group's lr (read at construction) by a warmup-then-cosine ratio.

    The ratio warms up from ``warmup_min_ratio`` to 1 like :class:`WarmupLR`, then follows
    ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = min(1, (it - warmup + 1) / max(1, total_num_steps - warmup))``, so it stays at
    ``cos_min_ratio`` from ``total_num_steps - 1`` on. Before the first ``step()`` the ratio
    is 0, so a fresh schedule sets every group's lr to 0.0 at construction.
    """

    def __init__(
        self,
        optimizer,
        total_num_steps,
        warmup_min_ratio=0.0,
        warmup_num_steps=1000,
        cos_min_ratio=0.0001,
        warmup_type=WARMUP_LOG_RATE,
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = effective_warmup_steps(warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = check_warmup_type(warmup_type)
        if total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)
        self.org_lrs = group_lrs(self.optimizer)
        self._init_lr()

    def get_lr_ratio(self):
        """The factor applied to every group's original lr at ``last_batch_iteration``."""
        iteration = self.last_batch_iteration
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            done = warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + done * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self):
        """Every group's original lr times :meth:`get_lr_ratio`."""
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]
