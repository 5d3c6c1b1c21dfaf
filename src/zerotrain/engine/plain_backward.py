"""Backward passes the engine did not start: ``loss.backward()`` on its outputs, ``scale(loss)``.

``engine(...)`` hands back aliases of the module's output tensors (``t.view_as(t)``: no copy),
each with a gradient hook. A backward that reaches one while no ``engine.backward()`` is running
is one the engine did not start: the first hook reached begins the stage's backward (accumulation
boundary and ``no_sync`` as ``engine.backward`` reads them, so the same buckets are launched and
at stage 3 the same gathers happen) and queues a callback that ends it when autograd finishes
the pass. Every hook multiplies the gradient by what ``engine.backward`` multiplies the loss by:
the loss scale over the accumulation steps (without the loss scale after ``engine.scale(loss)``).

Why aliases and not hooks on the outputs themselves: a model output may be computed from
another (Hugging Face's ``loss`` from its ``logits``). A hook on ``logits`` sees the gradient
that came through ``loss``'s hook too and scales it a second time (DeepSpeed 0.19's ZeRO 1/2
divide by the accumulation steps twice there). The model computed ``loss`` from its own
``logits``, not from the alias handed out, so every path from the user's loss to the parameters
crosses exactly one alias. An output modified in place (``out.logits.mul_(2)``) loses its alias's
hook (autograd rebases the view onto the model's tensor): its gradient then reaches the
parameters unscaled, or, when no other output began the backward, is refused by the stage.

Several engines: during one engine's ``engine.backward()`` another engine's outputs pass their
gradients through untouched (they accumulate in its buffers until its ``zero_grad()``/``step()``,
as in DeepSpeed). In a plain ``loss.backward()`` every engine whose outputs it reaches begins and
ends its own backward.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from zerotrain.engine.step_core import TrainingState
from zerotrain.engine.timers import BACKWARD, BACKWARD_INNER, BACKWARD_REDUCE

# Engines inside ``engine.backward()`` right now (weakly: the set keeps no engine alive).
_explicit: weakref.WeakSet = weakref.WeakSet()

DYNAMIC_SCALE_MESSAGE = (
    "fp16 with dynamic loss scaling: loss.backward() without the loss scale would under- or "
    "overflow unnoticed; call engine.scale(loss).backward() or engine.backward(loss)"
)


def _current_task() -> int:
    return torch._C._current_graph_task_id()


class PlainBackward:
    """One engine's bookkeeping of the backward passes it did not start."""

    def __init__(self, engine) -> None:
        self._engine = weakref.ref(engine)
        self.explicit = False  # inside engine.backward()
        self.task: int | None = None  # the autograd pass of an implicit backward under way
        self.factor = 1.0  # what that backward's hooks multiply gradients by
        self.prescaled_task: int | None = None  # the pass that started at engine.scale(loss)

    def _live_engine(self):
        """The engine, from the paths its own calls and its backward passes run (alive then)."""
        engine = self._engine()
        assert engine is not None
        return engine

    # -- engine.backward ------------------------------------------------------------------
    def begin_explicit(self) -> None:
        self.settle()
        self.explicit = True
        _explicit.add(self)

    def end_explicit(self) -> None:
        self.explicit = False
        _explicit.discard(self)

    # -- engine.scale -------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale; a backward from it is marked as scaled."""
        scale = self._live_engine().loss_scaler.loss_scale
        if scale == 1.0:
            return loss  # nothing to mark: the outputs' hooks multiply by the same factor either way
        scaled = loss.float() * scale
        scaled.register_hook(self._mark_prescaled)
        return scaled

    def _mark_prescaled(self, grad: torch.Tensor) -> torch.Tensor:
        # The scaled loss is the root of its backward: this runs before any output's hook.
        self.prescaled_task = _current_task()
        return grad

    # -- the outputs' aliases ------------------------------------------------------------
    def wrap_outputs(self, output):
        """``output`` with every tensor that requires grad replaced by a hooked alias."""
        if not torch.is_grad_enabled():
            return output
        return _replace_tensors(output, self._alias)

    def _alias(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad:
            return tensor
        alias = tensor.view_as(tensor)
        alias.register_hook(self._on_output_grad)
        return alias

    def _on_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if self._engine() is None:
            return grad  # outputs outliving their engine: nothing to begin
        if self.explicit or _explicit:
            return grad  # engine.backward() scaled the loss (this engine's, or another's backward)
        task = _current_task()
        if self.task != task:
            self._begin(task)
        return grad if self.factor == 1.0 else grad * self.factor

    def _begin(self, task: int) -> None:
        engine = self._live_engine()
        self.settle()
        engine._require_states("loss.backward()")
        scaler = engine.loss_scaler
        prescaled = self.prescaled_task == task
        if scaler.dynamic and not prescaled:
            raise RuntimeError(DYNAMIC_SCALE_MESSAGE)
        core = engine._core
        self.factor = core.backward_factor(loss_scaled=prescaled)
        engine._timers.start(BACKWARD)
        engine._zero.begin_backward(core.is_boundary(), core.in_no_sync)
        core.begin_phase(TrainingState.BACKWARD)  # ended by _end, or by settle() if the pass raised
        engine._timers.start(BACKWARD_INNER)
        self.task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        """Autograd finished the pass: wait for its reductions, as engine.backward does."""
        engine = self._live_engine()
        self.task, self.prescaled_task = None, None
        engine._timers.stop(BACKWARD_INNER)
        engine._timers.start(BACKWARD_REDUCE)
        try:
            engine._zero.end_backward()
        finally:
            engine._core.end_phase(TrainingState.BACKWARD)
        engine._timers.stop(BACKWARD_REDUCE)
        engine._timers.stop(BACKWARD)

    def settle(self) -> None:
        """An implicit backward that raised never reached its callback: drop what it launched."""
        if self.task is not None and self.task != _current_task():
            self.task, self.prescaled_task = None, None
            engine = self._live_engine()
            engine._zero.abort_backward()
            engine._core.end_phase(TrainingState.BACKWARD)
            engine._timers.stop(BACKWARD_INNER)
            engine._timers.stop(BACKWARD)


def _replace_tensors(value, replace):
    """``value`` with each tensor ``t`` in it (tuples, lists, dicts, dataclasses, nested)
    replaced by ``replace(t)``. Dicts and dataclasses are updated in place (a Hugging Face
    ``ModelOutput`` is both: item assignment keeps its attribute in step); containers of other
    types are left as they are."""
    if torch.is_tensor(value):
        return replace(value)
    if isinstance(value, dict):
        for key in list(value.keys()):
            new = _replace_tensors(value[key], replace)
            if new is not value[key]:
                value[key] = new
        return value
    if isinstance(value, tuple):
        items = [_replace_tensors(v, replace) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return type(value)(_replace_tensors(v, replace) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            old = getattr(value, field.name, None)
            new = _replace_tensors(old, replace)
            if new is not old:
                object.__setattr__(value, field.name, new)  # frozen dataclasses too
        return value
    return value
