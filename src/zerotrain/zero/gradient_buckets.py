"""Gradients grouped in buckets and reduced across ranks during backward.

A bucket is a list of parameters with a ``FlatLayout``. In *persistent* mode (stages 0 and 1)
each parameter's ``.grad`` is a view into the bucket's flat buffer, so autograd accumulates
straight into the buffer the collective sends: no copy, no per-step allocation. In *staged*
mode (stage 2) a bucket has no buffer of its own; the launch callback copies the finished
gradients into a reusable staging buffer and frees them.

A post-accumulate-grad hook counts the parameters that are done; buckets are launched as soon as
they are complete, strictly in bucket order, so every rank issues the same collectives in the
same sequence even when autograd finishes parameters in a different order.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from zerotrain.zero.flat import FlatLayout

# The gradient sets (one engine's buckets each) whose backward is under way right now. Each
# owns its state (``_in_backward``); this set only indexes them, weakly, because the question it
# answers is about the process's autograd, not one engine: a gradient reaching one engine's
# parameters while another engine runs backward (a GAN's generator loss flowing through the
# discriminator) accumulates there until that engine's zero_grad/step, as in DeepSpeed. An engine
# that leaves a backward unfinished stops counting once it is closed (``destroy()``), so it cannot
# make another engine accept gradients from a backward no engine began; held weakly, the set
# keeps no engine alive.
_in_backward: weakref.WeakSet[BucketedGradients] = weakref.WeakSet()


class Pending(Protocol):
    """A launched reduction: a collective's work handle, or anything else waited for alike."""

    def wait(self) -> object: ...


class GradientBucket:
    """Parameters whose gradients are reduced together."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        layout: FlatLayout | None = None,
        persistent: bool = True,
        dtype: torch.dtype | None = None,
    ):
        self.params = list(params)
        self.layout = layout or FlatLayout(self.params)
        flat = self.layout.empty(dtype=dtype) if persistent else None
        self.flat = flat
        self.views = self.layout.views(flat) if flat is not None else None
        # A buffer of another dtype than the parameters (e.g. fp32 accumulation of bf16
        # gradients) cannot be autograd's .grad: each backward's gradient is added into it.
        self.accumulates = flat is not None and flat.dtype != self.params[0].dtype
        self.seen = [False] * len(self.params)
        self.ready = 0
        self.work: Pending | None = None
        self.launched = False
        self.attach()

    def attach(self) -> None:
        """Point every parameter's ``.grad`` at its view of the flat buffer (persistent mode)."""
        if self.views is not None and not self.accumulates:
            for p, view in zip(self.params, self.views):
                p.grad = view

    def adopt(self, index: int) -> None:
        """Bring a ``.grad`` that autograd or the user replaced back into the buffer."""
        if self.views is None:
            return
        p, view = self.params[index], self.views[index]
        if self.accumulates:
            if p.grad is not None:
                view.add_(p.grad)
                p.grad = None
            return
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def copy_grad_range(self, out: torch.Tensor, start: int, end: int, divisor: float = 1) -> None:
        """Copy elements ``[start, end)`` of this bucket's flat gradient (as laid out, padding
        included) into ``out``, divided by ``divisor``, reading the parameters' ``.grad``."""
        filled = start
        for slot in self.layout.slots:
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo >= hi:
                continue
            if lo > filled:
                out.narrow(0, filled - start, lo - filled).zero_()
            grad = self.params[slot.index].grad
            piece = out.narrow(0, lo - start, hi - lo)
            if grad is None:
                piece.zero_()
            else:
                src = grad.reshape(-1).narrow(0, lo - slot.offset, hi - lo)
                if divisor == 1 or src.dtype != piece.dtype:
                    piece.copy_(src)
                    if divisor != 1:
                        piece.div_(divisor)
                else:  # one pass over the memory instead of a copy and a division
                    torch.div(src, divisor, out=piece)
            filled = hi
        if filled < end:
            out.narrow(0, filled - start, end - filled).zero_()

    def buffer(self) -> torch.Tensor:
        """The flat buffer of a persistent bucket (a staged one has none)."""
        assert self.flat is not None, "a staged bucket has no buffer of its own"
        return self.flat

    def free_grads(self) -> None:
        for p in self.params:
            p.grad = None

    @property
    def nbytes(self) -> int:
        return 0 if self.flat is None else self.flat.numel() * self.flat.element_size()


class BucketedGradients:
    """Gradients of ``buckets`` (lists of parameters), reduced by ``launch(bucket)``.

    ``layouts`` (default: unpadded) lets the buckets share the layout of partitioned
    parameter units, so a bucket's shard lines up with the unit's shard. ``launch`` starts a
    collective on a complete bucket and returns an object with ``wait()``
    (or None when nothing is pending). Reduction happens only in backward passes started with
    ``sync=True``; other passes just accumulate locally.
    """

    def __init__(
        self,
        buckets: Sequence[Sequence[torch.nn.Parameter]],
        launch: Callable[[GradientBucket], Pending | None],
        overlap: bool = True,
        layouts: Sequence[FlatLayout | None] | None = None,
        persistent: bool = True,
        dtype: torch.dtype | None = None,
        ordered: bool = True,
    ):
        layouts = layouts or [None] * len(buckets)
        self.buckets = [GradientBucket(b, layout, persistent, dtype) for b, layout in zip(buckets, layouts)]
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._launch = launch
        self._overlap = overlap
        # ordered: launch strictly in bucket order (robust to ranks finishing parameters in a
        # different order). Stage 3 launches each bucket as soon as it is complete instead, so a
        # finished unit's full-size gradients and parameters are freed at once; every rank runs
        # the same graph, so autograd completes the buckets in the same order everywhere.
        self._ordered = ordered
        self._next = 0
        self._in_backward = False
        self._sync = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in self.buckets for p in b.params
        ]

    # -- backward ------------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        _in_backward.add(self)
        self._in_backward, self._sync, self._next = True, sync, 0
        for b in self.buckets:
            b.ready, b.work, b.launched = 0, None, False
            b.seen = [False] * len(b.params)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket, index = self._where[id(param)]
        if not self._in_backward:
            if _in_backward:  # another engine's backward: keep it, reduce it with ours
                bucket.adopt(index)
                return
            raise RuntimeError(
                "a gradient reached the engine's parameters outside engine.backward() and not "
                "through the engine's outputs (a forward through engine.module?): run the forward "
                "as engine(...), then loss.backward() or engine.backward(loss), so gradients are "
                "reduced across ranks"
            )
        if bucket.launched:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} received a second gradient after its "
                "bucket was reduced in this backward (is it shared across reentrant activation "
                "checkpoints?); use torch.utils.checkpoint with use_reentrant=False"
            )
        bucket.adopt(index)
        if not bucket.seen[index]:
            bucket.seen[index] = True
            bucket.ready += 1
        if self._sync and self._overlap:
            if self._ordered:
                self._launch_ready()
            elif bucket.ready == len(bucket.params):
                self._launch_bucket(bucket)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.ready < len(bucket.params):
                return
            self._launch_bucket(bucket)

    def _launch_bucket(self, bucket: GradientBucket) -> None:
        bucket.launched = True
        bucket.work = self._launch(bucket)
        if self._ordered:
            self._next += 1

    def end_backward(self) -> None:
        """Launch what is left (e.g. unused parameters' buckets) and wait for all of it."""
        try:
            if self._sync:
                for bucket in self.buckets[self._next :]:
                    if not bucket.launched:
                        self._launch_bucket(bucket)
        finally:
            self._wait_all()

    def abort_backward(self) -> None:
        """Backward raised: wait for what was launched, launch nothing more."""
        self._wait_all()

    def _wait_all(self) -> None:
        try:
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
                    b.work = None
        finally:
            self._in_backward = False
            _in_backward.discard(self)

    @property
    def syncing(self) -> bool:
        """In a backward that reduces (ends an accumulation window, or any at stages 2-3)."""
        return self._in_backward and self._sync

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The tensor ``param``'s gradient accumulates in (None: not one of these buckets'):
        its view of the bucket's buffer (a ``.grad`` replaced since is folded in first), or,
        in staged mode, ``param.grad`` (created as zeros where no backward reached it)."""
        where = self._where.get(id(param))
        if where is None:
            return None
        bucket, index = where
        if bucket.views is not None:
            bucket.adopt(index)
            return bucket.views[index]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    # -- after backward ------------------------------------------------------------------
    def flats(self) -> list[torch.Tensor]:
        return [b.flat for b in self.buckets if b.flat is not None]

    def zero(self) -> None:
        for b in self.buckets:
            if b.flat is not None:
                b.flat.zero_()
                b.attach()
                if b.accumulates:
                    for p in b.params:
                        p.grad = None
            else:
                for p in b.params:
                    p.grad = None

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._in_backward = False  # closed: no backward of this engine is under way any more
        _in_backward.discard(self)
