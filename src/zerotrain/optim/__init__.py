"""Optimizers and learning-rate schedules, built from DeepSpeed-style config sections."""

from .cycle_schedules import LRRangeTest, OneCycle
from .factory import build_lr_scheduler, build_optimizer
from .lion import Lion
from .lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
from .placeholders import DummyOptim, DummyScheduler

__all__ = [
    "build_optimizer",
    "build_lr_scheduler",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
    "Lion",
    "DummyOptim",
    "DummyScheduler",
]
