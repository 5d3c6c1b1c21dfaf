"""Stage 3's backward side: ``BackwardGathers``, a base of ``ParameterCoordinator`` (zero/stage3.py,
whose docstring describes the whole scheme) holding what happens as backward reaches each module.

Each module's units are gathered again when backward reaches it (``_pre_backward``, from a hook
on its outputs) except that backward starts with the unit forward ended with, kept gathered in
between; an embedding's backward reads ids, not weights, so its unit gets shaped parameters over
0 bytes instead of a gather; a frozen unit is released as soon as its module's backward is over,
and a trained unit tied to an embedding is emptied once only embeddings still need it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from zerotrain.memory_release import ReleasePolicy
from zerotrain.zero.embedding_lookup import reads_no_weights
from zerotrain.zero.gather_buffers import GatherBuffers
from zerotrain.zero.partition import FlatParamUnit
from zerotrain.zero.passes import UseOrder

if TYPE_CHECKING:
    from zerotrain.zero.gradient_buckets import Pending


class BackwardGathers:
    """The coordinator's backward-pass gathers and releases."""

    # The coordinator's state and gathers these use (``ParameterCoordinator`` sets and defines them).
    memory_release: ReleasePolicy
    buffers: GatherBuffers
    live_numel: int
    pool_drops: int
    early_releases: int
    hollowed: int
    _forward_order: UseOrder
    _backward_order: UseOrder
    _inflight: dict[FlatParamUnit, Pending]
    _keep_whole: set[FlatParamUnit]
    _shared: set[FlatParamUnit]
    _users: dict[FlatParamUnit, list[nn.Module]]
    _done: dict[FlatParamUnit, set[nn.Module]]
    _hollow: set[FlatParamUnit]
    release: Callable[[FlatParamUnit], None]
    release_all: Callable[[], None]
    _use: Callable[..., None]
    _drop_pool: Callable[[], None]

    # -- the unit kept from forward to backward ---------------------------------------
    # Backward starts with the module forward ended with (the output layer), so its units are
    # not released between the two: one all-gather of the largest unit less per step (GPT-2's
    # tied embedding: 23-31% of the model), as FSDP2 keeps its root's parameters. They stay
    # gathered while the loss is computed, which is below the step's peak (the output layer's
    # backward holds them with their gradient beside them).
    _held: FlatParamUnit | None = None

    def _first_of_backward(self, used) -> FlatParamUnit | None:
        """The unit of ``used`` that the recorded backward gathers first, once this forward has
        gathered every unit of its recorded order (nothing new comes after this module)."""
        forward, backward = self._forward_order, self._backward_order
        if forward.at_end and not backward.recording and backward.order:
            first = backward.order[0]
            if first in used and first not in self._keep_whole:
                return first
        return None

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self.release(held)

    def _pre_backward(self, units, module: nn.Module) -> None:
        # Under "eager" the first use (the output layer's backward) gathers nothing ahead.
        peak_start = self._first_backward_use and self.memory_release.eager
        if self._first_backward_use:
            # The loss's backward (before any module's) freed its heap temporaries (the
            # log-softmax output and gradient: 64 MiB on the 110M GPT-2) just as the first
            # units are gathered: hand them back first, or the peak holds both.
            self._first_backward_use = False
            if peak_start:
                # The output layer's backward is the step's peak (every activation saved, its
                # weight gathered, its weight gradient allocated): hold no idle pooled buffers
                # there, and gather nothing ahead until it is over (110M GPT-2: -38 MiB at the
                # peak; backward's own releases refill the pool from the next unit on).
                self._drop_pool()
                self.pool_drops += 1
            self.memory_release.before_backward()
        for unit in units:
            if reads_no_weights(module) and (unit in self._hollow or self._hollow_out(unit)):
                continue
            self._use(unit, prefetch=not peak_start)

    def _hollow_out(self, unit: FlatParamUnit) -> bool:
        """A released unit that only embeddings used in this forward (an untied input embedding,
        GPT-2's position embedding), at its embedding's backward, which reads indices, not
        weights: its parameters get their shapes back over a storage holding no memory (the
        gradient accumulates against them) instead of an all-gather of the whole table (a Llama
        vocabulary: the model's largest unit)."""
        users = self._users.get(unit, ())
        if (
            unit.gathered
            or unit in self._inflight
            or unit in self._keep_whole
            or not users
            or not all(reads_no_weights(m) for m in users)
        ):
            return False
        self._attach_empty(unit)
        self._hollow.add(unit)
        self.hollowed += 1
        return True

    def _attach_empty(self, unit: FlatParamUnit) -> None:
        """Give a released unit's parameters their shapes over its own storage, holding 0 bytes."""
        self.buffers.attach_empty(unit)
        self.live_numel += unit.layout.padded_numel  # what release() takes off; holds no memory

    def _module_backward_done(self, units, module: nn.Module) -> None:
        """``module``'s backward is over: a tied unit whose users still to come in this backward
        are all embeddings (their backward reads indices, not weights) is emptied now."""
        for unit in units:
            done = self._done.setdefault(unit, set())
            done.add(module)
            rest = [m for m in self._users.get(unit, ()) if m not in done]
            if (
                rest
                and all(reads_no_weights(m) for m in rest)
                and unit.gathered
                and unit not in self._inflight
                and unit not in self._keep_whole
                and self.buffers.own_storage.get(unit) is unit.flat
                and unit not in self._hollow
            ):
                assert unit.flat is not None  # gathered
                unit.flat.untyped_storage().resize_(0)
                self._hollow.add(unit)
                self.hollowed += 1

    def _post_backward(self, frozen_units) -> None:
        for unit in frozen_units:
            if unit.gathered and unit not in self._shared and unit not in self._keep_whole:
                self.release(unit)
                self.early_releases += 1

    # -- backward boundaries ------------------------------------------------------------
    _first_backward_use = False

    def begin_backward(self) -> None:
        self._held = None  # backward releases it like any unit it uses
        self._backward_order.start()
        self._first_backward_use = True
        self._done = {}

    def end_backward(self) -> None:
        self._backward_order.finish()
        self.release_all()
