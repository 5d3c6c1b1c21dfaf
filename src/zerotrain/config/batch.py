"""DeepSpeed's batch-size rule: train_batch_size = micro_batch_per_gpu * grad_accum_steps * world_size."""

from __future__ import annotations

from .ranges import MAX_BATCH, check_grad_accum

TB, MB, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def resolve_batch_sizes(
    train_batch: int | None, micro_batch: int | None, grad_acc: int | None, world_size: int
) -> tuple[int, int, int]:
    """Return (train_batch_size, micro_batch_per_gpu, grad_accum_steps), deriving the missing ones.

    Any two given values determine the third; train_batch_size alone or micro batch alone imply
    gradient_accumulation_steps = 1. `world_size` is the data-parallel size. Raises ValueError
    (with every number involved) when the values cannot satisfy the rule.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (the data-parallel size), got {world_size!r}")
    if train_batch is None and micro_batch is None:
        raise ValueError(
            f"either {TB} or {MB} needs to be provided"
            + (f" ({GAS} alone is not enough)" if grad_acc is not None else "")
        )
    if train_batch is not None and micro_batch is not None and grad_acc is None:
        grad_acc = _divide(train_batch, GAS, [(MB, micro_batch)], world_size)
    elif train_batch is not None and grad_acc is not None and micro_batch is None:
        micro_batch = _divide(train_batch, MB, [(GAS, grad_acc)], world_size)
    elif train_batch is not None and micro_batch is None:
        grad_acc = 1
        micro_batch = _divide(train_batch, MB, [], world_size)
    else:
        grad_acc = 1 if grad_acc is None else grad_acc
        train_batch = micro_batch * grad_acc * world_size if train_batch is None else train_batch
    _check_product(train_batch, micro_batch, grad_acc, world_size)
    _check_bounds(train_batch, micro_batch, grad_acc, world_size)
    return train_batch, micro_batch, grad_acc


def _divide(train_batch: int, missing: str, factors: list[tuple[str, int]], world_size: int) -> int:
    factors = factors + [("world_size", world_size)]
    divisor = 1
    for _, value in factors:
        divisor *= value
    if train_batch % divisor:
        shown = " * ".join(f"{name} {value}" for name, value in factors)
        shown += f" = {divisor}" if len(factors) > 1 else ""
        raise ValueError(
            f"cannot derive {missing}: {TB} {train_batch} is not divisible by {shown}; "
            f"change {TB} or set {missing} explicitly"
        )
    return train_batch // divisor


def _check_product(train_batch: int, micro_batch: int, grad_acc: int, world_size: int) -> None:
    product = micro_batch * grad_acc * world_size
    if train_batch != product:
        raise ValueError(
            f"{TB} {train_batch} != {MB} {micro_batch} * {GAS} {grad_acc} * world_size {world_size}"
            f" = {product}; fix one of them, or leave one out and it is derived from the others"
        )


def _check_bounds(train_batch: int, micro_batch: int, grad_acc: int, world_size: int) -> None:
    # The given values are bounded by the schema; these catch the derived ones.
    shown = f" (= {TB} {train_batch} / ({MB} {micro_batch} * world_size {world_size}))"
    check_grad_accum(grad_acc, shown)
    if train_batch > MAX_BATCH:
        raise ValueError(
            f"{TB} {train_batch} (= {MB} {micro_batch} * {GAS} {grad_acc} * world_size {world_size}) "
            f"is above {MAX_BATCH} samples; lower {MB} or {GAS}"
        )
