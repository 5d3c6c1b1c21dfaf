"""fp32 master weights of 16-bit parameters: take into the master only what was edited outside it."""

from __future__ import annotations

import torch


def adopt_changed(master: torch.Tensor, weights: torch.Tensor) -> None:
    """Copy into the fp32 ``master`` the 16-bit ``weights`` that differ from its rounding: edited
    values are taken, untouched ones keep their fp32 precision."""
    if weights.device != master.device:  # offloaded master (host) of device weights
        weights = weights.to(master.device)
    if weights.dtype == master.dtype:
        master.copy_(weights)
        return
    changed = weights != master.to(weights.dtype)
    master.copy_(torch.where(changed, weights.to(master.dtype), master))
