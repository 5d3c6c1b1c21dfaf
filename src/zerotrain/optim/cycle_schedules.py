"""Cyclic and range-test lr schedules with DeepSpeed's names, parameters and semantics."""

import math

from ..log import logger
from .lr_schedules import BatchLRScheduler, apply_lrs, check_positive_int, per_group

# DeepSpeed's OneCycle writes betas = (momentum, 0.99) whenever it cycles momentum, replacing
# whatever beta2 the optimizer was built with; we keep that so configs train the same way.
ONE_CYCLE_BETA2 = 0.99


class LRRangeTest(BatchLRScheduler):
    """Grow the lr from ``lr_range_test_min_lr`` to find the largest lr that still trains.

    lr = min_lr * (1 + step_rate * i), with i = (it + 1) / step_size, floored when
    ``lr_range_test_staircase`` is set. A fresh schedule sets min_lr at construction.

    Args:
        optimizer: the torch optimizer (or a wrapper exposing it as ``.optimizer``).
        lr_range_test_min_lr (float or list): starting lr, per group if a list. Default 1e-3.
        lr_range_test_step_size (int): iterations per unit of increase. Default 2000.
        lr_range_test_step_rate (float): increase per unit. Default 1.0.
        lr_range_test_staircase (bool): increase in whole steps. Default False.
        last_batch_iteration (int): -1 to start fresh, else the iteration to resume after.
    """

    def __init__(
        self,
        optimizer,
        lr_range_test_min_lr=1e-3,
        lr_range_test_step_size=2000,
        lr_range_test_step_rate=1.0,
        lr_range_test_staircase=False,
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        check_positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._init_lr()

    def get_lr(self):
        """min_lr times the current increase factor, for every group."""
        intervals = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            intervals = math.floor(intervals)
        factor = 1.0 + self.step_rate * intervals
        return [lr * factor for lr in self.min_lrs]


class OneCycle(BatchLRScheduler):
    """One triangular lr cycle (with momentum moving the opposite way), then a decay phase.

    Within the cycle, with ``b = it + 1`` and ``total = first + second`` step sizes, the
    lr rises linearly from ``cycle_min_lr`` (b = 0) to ``cycle_max_lr`` (b = first) and falls
    back to ``cycle_min_lr`` (b = total). A stair count > 0 holds each of that many stairs
    flat. From ``it = total`` on, with ``d = it - total + 1``, lr = min_lr / (1 + decay_lr_rate
    * d / decay_step_size) (continuous, not stepped), or min_lr when decay is off.

    Momentum (``betas[0]``, only for optimizers whose defaults have ``betas``) mirrors the
    lr between ``cycle_max_mom`` and ``cycle_min_mom`` and then grows as max_mom * (1 +
    decay_mom_rate * d / decay_step_size). Optimizers without betas (SGD) keep their
    momentum: DeepSpeed disables momentum cycling for them with a warning, and so do we.

    A fresh schedule sets lr = cycle_min_lr and betas = (cycle_min_mom, 0.99) at construction,
    as DeepSpeed does, although the cycle itself starts at cycle_max_mom. The lr and
    momentum bounds may be per-group lists.
    """

    def __init__(
        self,
        optimizer,
        cycle_min_lr,
        cycle_max_lr,
        decay_lr_rate=0.0,
        cycle_first_step_size=2000,
        cycle_second_step_size=None,
        cycle_first_stair_count=0,
        cycle_second_stair_count=None,
        decay_step_size=0,
        cycle_momentum=True,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.0,
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self._init_cycle(
            cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count
        )
        self.min_lrs = per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        self.cycle_momentum = cycle_momentum and self._has_betas()
        if self.cycle_momentum:
            self.min_moms = per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")
            self.max_moms = per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")
        if last_batch_iteration == -1:
            self._last_lr = apply_lrs(self.optimizer, self.min_lrs)
            if self.cycle_momentum:
                self._apply_momentum(self.min_moms)

    def _init_cycle(self, first_size, second_size, first_stairs, second_stairs):
        if first_size <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first_size!r}")
        second_size = first_size if second_size is None else second_size
        if second_size < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second_size!r}")
        self.first_step_size = float(first_size)
        self.second_step_size = float(second_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.first_stair_count = first_stairs
        self.second_stair_count = first_stairs if second_stairs is None else second_stairs

    def _has_betas(self):
        if "betas" in self.optimizer.defaults:
            return True
        logger.warning(
            "OneCycle: cycle_momentum is disabled because optimizer %s has no betas", type(self.optimizer).__name__
        )
        return False

    def _scale_factor(self):
        """Position in the cycle: 0 at cycle_min_lr, 1 at cycle_max_lr."""
        position = (self.last_batch_iteration + 1) % self.total_size
        if position <= self.first_step_size:
            distance, size, stairs = position, self.first_step_size, self.first_stair_count
        else:
            distance, size, stairs = self.total_size - position, self.second_step_size, self.second_stair_count
        if stairs > 0:
            # Multiply before dividing so an exact stair boundary is not floored one stair down.
            return math.floor(distance * stairs / size) / stairs
        return distance / size

    def _decay_intervals(self):
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def _in_cycle(self):
        return self.last_batch_iteration < self.total_size

    def _decay_off(self, rate):
        return math.isclose(self.decay_step_size, 0) or math.isclose(rate, 0)

    def get_lr(self):
        """The lr of every group at ``last_batch_iteration``."""
        if self._in_cycle():
            scale = self._scale_factor()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self._decay_off(self.decay_lr_rate):
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_intervals()
        return [lr / factor for lr in self.min_lrs]

    def get_mom(self):
        """``betas`` of every group at ``last_batch_iteration``, or None if momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self._in_cycle():
            scale = self._scale_factor()
            moms = [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        elif self._decay_off(self.decay_mom_rate):
            moms = list(self.max_moms)
        else:
            factor = 1.0 + self.decay_mom_rate * self._decay_intervals()
            moms = [mom * factor for mom in self.max_moms]
        return [(mom, ONE_CYCLE_BETA2) for mom in moms]

    def _apply_momentum(self, moms):
        for group, mom in zip(self.optimizer.param_groups, moms):
            group["betas"] = (mom, ONE_CYCLE_BETA2)

    def step(self, last_batch_iteration=None):
        """Advance to ``last_batch_iteration`` (default: the next one); apply lr and momentum."""
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._apply_momentum([betas[0] for betas in self.get_mom()])
