"""ZeRO stage 3: gather partitioned parameters just before a module uses them, free them after.

``ParameterCoordinator`` installs forward hooks on every module that owns partitioned units:
before the module runs, its units are all-gathered (the module's parameters become views of the
full buffers); after it, they are released again, and a hook on the module's outputs gathers them
once more when backward reaches the module. A unit's full buffer is released in backward as soon
as its gradients have been reduce-scattered; a frozen unit (nothing to reduce: a LoRA model's
base) as soon as the gradients with respect to its module's inputs are computed, i.e. when the
module's backward is over, unless another module call uses it too (tied weights, a module called
twice), which keeps it until the end of backward.

Three gathers are left out: the unit backward starts with stays gathered from the end of forward
(the output layer's); an embedding's backward reads ids, not weights, so its unit gets shaped
parameters over 0 bytes instead; and an embedding alone in its unit looks its rows up from the
shards while that moves less than its table (zero/embedding_lookup.py).

Parameters used outside their own module (tied weights, ``other.weight`` in a forward) are caught
where they are read: each module's ``_parameters`` dict gathers a released parameter on access
during a forward pass.

The order in which units are used is recorded on the first pass (forward and backward
separately); later passes start gathering the next units ahead of use (up to
``stage3_prefetch_bucket_size`` elements, and never beyond ``stage3_max_live_parameters`` live
elements), overlapping communication with compute. A pass that departs from the record
re-records it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from zerotrain.memory_release import ReleasePolicy
from zerotrain.zero import embedding_lookup
from zerotrain.zero.divergence import CollectiveChecks
from zerotrain.zero.embedding_lookup import reads_no_weights
from zerotrain.zero.interface import GatherStatistics
from zerotrain.zero.leaves import unit_parameters
from zerotrain.zero.partition import FlatParamUnit
from zerotrain.zero.passes import UseOrder, before_backward_of, in_backward, output_tensors, unique

if TYPE_CHECKING:
    from zerotrain.zero.gradient_buckets import Pending


class _GatheringParameters(dict):
    """A module's ``_parameters`` that gathers a partitioned parameter when read in a forward."""

    def __init__(self, coordinator: ParameterCoordinator, params: dict):
        super().__init__(params)
        self._coordinator = coordinator

    def __getitem__(self, name):
        param = super().__getitem__(name)
        if param is not None:
            self._coordinator.on_access(param)
        return param


class ParameterCoordinator:
    """Fetches and releases the partitioned units of ``module``'s parameters around their use."""

    def __init__(
        self,
        module: nn.Module,
        units: Sequence[FlatParamUnit],
        group=None,
        prefetch_numel: int = 0,
        max_live_numel: int | None = None,
        leaf_of: dict | None = None,
        memory_release: ReleasePolicy | None = None,
        unit_groups: dict | None = None,
        param_swapper=None,
        checks: CollectiveChecks = CollectiveChecks(),
    ):
        self.units = list(units)
        self.group = group
        # NVMe parameter offload (a zerotrain.offload.params.ParamSwapper): shards are read
        # ahead along the recorded order of use.
        self.param_swapper = param_swapper
        self.checks = checks  # every gather's identity and agreement check (zero/divergence.py)
        # Units sharded over another group than ``group`` (experts: their expert-data group).
        self._unit_groups = dict(unit_groups or {})
        # The engine's policy (None: the environment's or stage 3's default)
        self.memory_release = memory_release if memory_release is not None else ReleasePolicy()
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.live_numel = 0
        self.peak_live_numel = 0
        # Released full buffers kept for the next gather of the same size: steady-state steps
        # allocate nothing. Pooled + live elements never exceed the peak of live elements.
        # A buffer autograd still refers to (views saved for backward) is never pooled.
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self.pool_numel = 0
        self.buffers_allocated = 0  # full buffers allocated for gathers so far (not reused)
        self.pool_drops = 0  # backwards that began by dropping the pool ("eager")
        # Units whose buffer autograd still referred to at a release keep that buffer as their
        # own: emptied (storage of 0 bytes) while released, refilled in place when gathered.
        self._own_storage: dict[FlatParamUnit, torch.Tensor] = {}
        # Units used by a module whose outputs hold no tensor we can hook: never emptied.
        self._keep_whole: set[FlatParamUnit] = set()
        # Frozen units used by more than one module call in a forward pass: their release after
        # one call's backward could race another call's (autograd interleaves parallel
        # branches), so they wait for end_backward.
        self._calls: dict[FlatParamUnit, int] = {}
        self._shared: set[FlatParamUnit] = set()
        self.early_releases = 0  # frozen units released when their module's backward ended
        # Tied trained units (an embedding shared with the output layer) whose remaining users
        # in this backward are embeddings, which need no weights: after the other user's
        # backward their storage is emptied, the parameters keeping their shape (the gradient
        # is accumulated against it); any later gather refills it.
        self._users: dict[FlatParamUnit, list[nn.Module]] = {}
        self._done: dict[FlatParamUnit, set[nn.Module]] = {}
        self._hollow: set[FlatParamUnit] = set()
        self.hollowed = 0  # units emptied that way so far
        self.storage_refills = 0  # gathers into such an emptied storage (each allocates)
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        # Forward saves activations on the heap between freed temporaries; the holes grow with
        # depth (110M GPT-2: ~100 MiB by the output layer). Under memory_release "eager" they
        # are handed back each eighth of the model gathered, and before any larger gather.
        self._forward_trim = self.memory_release.trim_every(sum(u.layout.padded_numel for u in self.units) // 8)
        self._position = {u: i for i, u in enumerate(self.units)}
        for u in self.units:
            u.coordinator = self
        self._inflight: dict[FlatParamUnit, Pending] = {}  # gathers started, not waited for
        self._stack: list[tuple[nn.Module, set]] = []
        self._forward_order, self._backward_order = UseOrder(), UseOrder()
        self.hook_handles: list = []  # the forward hooks of register_hooks(), removable
        self._module_units: dict[nn.Module, list[FlatParamUnit]] = {}
        self._hooked: list[nn.Module] = []  # every module whose forward the hooks follow
        self._wrapped: list[nn.Module] = []  # modules whose _parameters gather on access
        leaf_of = leaf_of or {}
        for m in module.modules():
            if any(id(p) in self._unit_of for p in m._parameters.values() if p is not None):
                m._parameters = _GatheringParameters(self, m._parameters)
                self._wrapped.append(m)
            params = unit_parameters(m, leaf_of)
            if params is None:
                continue  # inside a leaf: the leaf's hooks gather and release its whole subtree
            own = unique(self._unit_of.get(id(p)) for p in params)
            if own:
                self._module_units[m] = own
            self._hooked.append(m)
        self._root = module
        self.register_hooks()
        # Embeddings alone in their unit look their rows up from the shards while that moves
        # less than the table; their forward is the lookup's until close().
        self._lookups = embedding_lookup.Lookups(
            {m: own[0] for m, own in self._module_units.items() if len(own) == 1 and own[0] not in self._unit_groups},
            self.group_of,
            self._attach_empty,
            self._identity,
        )

    @property
    def module(self) -> nn.Module:
        """The module whose forwards this coordinator follows."""
        return self._root

    @property
    def forward_stack(self) -> list[tuple[nn.Module, set]]:
        """The modules whose forward is running, outermost first, each with the units it uses."""
        return self._stack

    # -- the hooks ----------------------------------------------------------------------
    def register_hooks(self) -> None:
        """Follow every module's forward (gathering and releasing around it), once: handles
        still registered are replaced."""
        self.remove_hooks()
        for m in self._hooked:
            self.hook_handles.append(m.register_forward_pre_hook(self._pre_forward))
            self.hook_handles.append(m.register_forward_hook(self._post_forward, with_kwargs=True))

    def remove_hooks(self) -> None:
        """Stop following forwards: what runs then (generation inside ``GatheredParameters``
        over the whole model) gathers nothing, and issues no collective."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []

    @property
    def trace_recorded(self) -> bool:
        """Whether a forward's order of gathers is recorded, which prefetching follows."""
        return not self._forward_order.recording

    def invalidate_trace(self) -> None:
        """Forget the recorded orders of use: the next forward and backward record them again
        (after passes of another shape, such as generation, the record would mislead the
        prefetch)."""
        self._forward_order, self._backward_order = UseOrder(), UseOrder()

    # -- gathering ----------------------------------------------------------------------
    def fetch(self, unit: FlatParamUnit) -> None:
        """Make ``unit``'s full parameters available (waiting for a prefetch if one is running)."""
        work = self._inflight.pop(unit, None)
        if work is not None:
            work.wait()
            unit.finish_gather()
            return
        if unit in self._hollow:  # emptied in backward, used again (e.g. recomputation)
            self._hollow.discard(unit)
        elif unit.gathered:
            return
        else:
            self._count(unit.layout.padded_numel)
        self._before_allocating(unit)
        self._agree(unit)
        unit.start_gather(self.group_of(unit), self._acquire(unit), self._identity(unit)).wait()
        unit.finish_gather()

    def group_of(self, unit: FlatParamUnit):
        """The group ``unit`` is sharded (and gathered) over."""
        return self._unit_groups.get(unit, self.group)

    def _prefetch(self, order: UseOrder) -> None:
        # The window counts what is already in flight: without that, every use started another
        # full window and the whole model ended up gathered ahead of use.
        budget = self.prefetch_numel - sum(u.layout.padded_numel for u in self._inflight)
        for unit in order.upcoming():
            if budget <= 0:
                return
            if unit.gathered or unit in self._inflight or unit in self._skipped:
                continue
            numel = unit.layout.padded_numel
            if self.max_live_numel is not None and self.live_numel + numel > self.max_live_numel:
                return
            if not self.start_fetch(unit):
                return
            budget -= numel

    def start_fetch(self, unit: FlatParamUnit) -> bool:
        """Start gathering ``unit`` without waiting for it (``fetch`` waits); False when it is
        not started: gathered or in flight already, or its shard on disk with no read issued
        (gathering would wait for that)."""
        if unit.gathered or unit in self._inflight:
            return False
        if self.param_swapper is not None and not self.param_swapper.ready(unit):
            return False
        self._before_allocating(unit)
        self._agree(unit)
        self._count(unit.layout.padded_numel)
        self._inflight[unit] = unit.start_gather(self.group_of(unit), self._acquire(unit), self._identity(unit))
        return True

    def _before_allocating(self, unit: FlatParamUnit) -> None:
        if not in_backward():
            self._forward_trim.reduced(unit.layout.padded_numel)

    # Units of modules the coming pass will not call (blocks progressive layer dropping skips,
    # set by the engine before each forward): never gathered ahead of use, in that forward and
    # its backward (a real use still gathers them).
    _skipped: frozenset = frozenset()

    def skip_prefetch(self, modules) -> None:
        """The units of ``modules`` (and their submodules) are not prefetched until the next call."""
        self._skipped = frozenset(
            unit for module in modules for sub in module.modules() for unit in self._module_units.get(sub, ())
        )

    def _agree(self, unit: FlatParamUnit) -> None:
        if self.checks.agreement is not None:
            self.checks.agreement.check("gather", self._position[unit])

    def _identity(self, unit: FlatParamUnit):
        identities = self.checks.identities
        return None if identities is None else identities.gather(self._position[unit])

    def release_reduced(self, unit: FlatParamUnit) -> None:
        """``unit``'s gradients are reduced: backward needs its full parameters no more."""
        if unit.resharded:
            self.release(unit)

    def release(self, unit: FlatParamUnit) -> None:
        work = self._inflight.pop(unit, None)
        if work is not None:
            work.wait()
        self._hollow.discard(unit)
        if unit.gathered:
            flat = unit.release()
            self.live_numel -= unit.layout.padded_numel
            if flat is None:
                return
            if unit in self._keep_whole:
                pass  # no backward hook re-gathers it: whatever autograd holds must stay valid
            elif unit in self._own_storage or not _sole_owner(flat):
                # Autograd saved views of it for backward (nn.Linear saves ``weight.t()``): free
                # its memory anyway and refill this same storage at the next gather, so those
                # views read the gathered values again (FSDP2 frees unsharded parameters the same
                # way). Dropping the buffer instead would keep every layer whole until backward.
                # Such a unit keeps this storage from now on (pooling it would hand the pool's
                # buffers to autograd every forward).
                flat.untyped_storage().resize_(0)
                self._own_storage[unit] = flat
            elif self.pool_numel + self.live_numel + flat.numel() <= self.peak_live_numel:
                self._pool.setdefault(_key(flat), []).append(flat)
                self.pool_numel += flat.numel()

    # -- the buffer pool ----------------------------------------------------------------
    def _acquire(self, unit: FlatParamUnit) -> torch.Tensor:
        """A full buffer for ``unit``: a pooled one nothing else refers to any more (autograd may
        still hold views of a buffer released in forward), else a new one."""
        layout = unit.layout
        own = self._own_storage.get(unit)
        if own is not None:  # emptied at its last release: refill the same storage
            own.untyped_storage().resize_(layout.padded_numel * own.element_size())
            self.storage_refills += 1
            return own
        free = self._pool.get((layout.padded_numel, layout.dtype, layout.device), [])
        for i, buf in enumerate(free):
            if _sole_owner(buf):
                self.pool_numel -= buf.numel()
                return free.pop(i)
        self.buffers_allocated += 1
        if self.pool_numel + self.live_numel > self.peak_live_numel:
            self._trim_pool()
        return layout.empty(zero=False)

    def _trim_pool(self) -> None:
        """Drop pooled buffers until pooled + live elements fit in the peak again."""
        for key in sorted(self._pool, key=lambda k: -k[0]):
            free = self._pool[key]
            while free and self.pool_numel + self.live_numel > self.peak_live_numel:
                self.pool_numel -= free.pop().numel()
        self._pool = {k: v for k, v in self._pool.items() if v}

    def _drop_pool(self) -> None:
        self._pool, self.pool_numel = {}, 0

    @property
    def pool_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for free in self._pool.values() for b in free)

    def gather_statistics(self) -> GatherStatistics:
        """The gathers' numbers now (``StageStatistics.gathers``)."""
        element = self.units[0].dtype.itemsize if self.units else 0
        return GatherStatistics(
            gathered_bytes=self.live_numel * element,
            peak_gathered_bytes=self.peak_live_numel * element,
            pool_bytes=self.pool_nbytes,
            buffers_allocated=self.buffers_allocated,
            pool_drops=self.pool_drops,
            early_releases=self.early_releases,
            hollowed=self.hollowed,
            storage_refills=self.storage_refills,
        )

    def release_all(self) -> None:
        for unit in self.units:
            self.release(unit)

    def empty_cache(self) -> None:
        """Release every gathered unit (the one kept from forward into backward, prefetched
        ones) and drop the pooled buffers: ``engine.empty_partition_cache()``. Safe between a
        forward and its backward: a released unit whose buffer autograd saved views of is
        refilled in place when backward gathers it again."""
        if in_backward():
            raise RuntimeError(
                "empty_partition_cache() during a backward pass: call it between "
                "training steps or between a forward and its backward"
            )
        self._held = None
        self.release_all()  # in-flight ones too: release() waits for their gather
        self._drop_pool()

    def _count(self, numel: int) -> None:
        self.live_numel += numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _use(self, unit: FlatParamUnit, prefetch: bool = True) -> None:
        order = self._backward_order if in_backward() else self._forward_order
        matched = order.see(unit)
        if matched and self.param_swapper is not None:  # shards of units still to gather
            self.param_swapper.read_ahead(u for u in order.upcoming() if not u.gathered and u not in self._inflight)
        self.fetch(unit)
        if matched and prefetch and self.prefetch_numel:
            self._prefetch(order)
        if matched and order.at_end and not self._inflight and self.memory_release.eager:
            # The pass's last gather: pooled buffers would only sit through its peak (the output
            # layer's forward; the embedding's backward). GPT-2 110M: -12 MiB fp32, -5 MiB bf16.
            self._drop_pool()

    # -- hooks --------------------------------------------------------------------------
    def on_access(self, param: nn.Parameter) -> None:
        unit = self._unit_of.get(id(param))
        if unit is None or not self._stack:
            return  # outside a forward: use zerotrain.zero.GatheredParameters
        used = self._stack[-1][1]
        if unit in used and unit.gathered and unit not in self._hollow and unit not in self._inflight:
            return  # read again inside the module that gathered it (each weight access lands here)
        if unit not in used:
            used.add(unit)
            self._note_call(unit)
        self._use(unit)

    def _note_call(self, unit: FlatParamUnit) -> None:
        if not unit.trained and not in_backward():
            self._calls[unit] = self._calls.get(unit, 0) + 1
            if self._calls[unit] > 1:
                self._shared.add(unit)

    def _pre_forward(self, module: nn.Module, args) -> None:
        if module is self._root and not in_backward():
            self._forward_order.start()
            self._calls, self._users = {}, {}
            self._release_held()  # no backward ran since (a step may have changed its shard)
        own = self._module_units.get(module, ())
        self._stack.append((module, set(own)))
        for unit in own:
            self._note_call(unit)
            if module not in self._lookups:  # its forward gathers or looks up
                self._use(unit)

    def _post_forward(self, module: nn.Module, args, kwargs, output):
        _, used = self._stack.pop()
        backward = in_backward()
        held = None
        if used and torch.is_grad_enabled():
            tensors = [t for t in output_tensors(output) if t.requires_grad]
            if tensors:
                if not backward:
                    held = self._first_of_backward(used)
                # Gathered in a fixed order: a set iterates in id order, which differs between
                # ranks, and the gathers are collectives every rank must issue alike.
                ordered = tuple(sorted(used, key=self._position.__getitem__))
                before_backward_of(tensors, lambda units=ordered, m=module: self._pre_backward(units, m))
                frozen = tuple(u for u in ordered if not u.trained)
                inputs = [t for t in output_tensors((args, kwargs)) if t.requires_grad]
                tied = tuple(u for u in ordered if u.trained and self._users.get(u))
                if tied and inputs and not backward:
                    register_multi_grad_hook(
                        inputs, lambda grads, units=tied, m=module: self._module_backward_done(units, m), mode="all"
                    )
                if frozen and inputs:
                    # "all": once every input's gradient is computed, the module's backward is
                    # over (a frozen unit is needed for nothing else). Releasing is local; only
                    # gathers are collectives, and those happen in the same order on every rank.
                    # Also for a forward recomputed in backward (reentrant checkpointing runs the
                    # first forward without grad, so only the recomputation can say it).
                    register_multi_grad_hook(inputs, lambda grads, units=frozen: self._post_backward(units), mode="all")
            else:  # outputs we cannot see into: backward will not gather these units again
                self._keep_whole.update(used)
                for unit in used:
                    self._own_storage.pop(unit, None)
        if not backward:
            for unit in used:
                self._users.setdefault(unit, []).append(module)
            still_used = set().union(*(u for _, u in self._stack)) if self._stack else set()
            for unit in used - still_used:
                if unit is held:
                    self._held = unit
                else:
                    self.release(unit)
        if module is self._root and not backward:
            self._forward_order.finish()
            for unit in list(self._inflight):  # prefetched but not used on this path
                self.release(unit)
        return None

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
        # Views need the memory to exist when made: allocated untouched and handed back at
        # once, no page is written.
        storage = self._own_storage.get(unit)
        if storage is None:
            storage = self._own_storage[unit] = unit.layout.empty(zero=False)
        else:
            storage.untyped_storage().resize_(unit.layout.padded_numel * storage.element_size())
        unit.attach(storage)
        storage.untyped_storage().resize_(0)
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
                and self._own_storage.get(unit) is unit.flat
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

    def close(self) -> None:
        """Hand the module back whole: every unit gathered into parameters that own their
        storage, hooks removed, each module's plain ``_parameters`` dict and the parameters'
        attributes restored (collective: every rank must call it)."""
        self.remove_hooks()
        self._lookups.restore()
        for unit in self.units:
            self.fetch(unit)
            with torch.no_grad():
                for p, view in zip(unit.params, unit.layout.views(unit.full_buffer())):
                    p.data = view.clone()
            unit.flat = None
            self.live_numel -= unit.layout.padded_numel
        for m in self._wrapped:
            if isinstance(m._parameters, _GatheringParameters):
                m._parameters = dict(m._parameters)
        for u in self.units:
            u.coordinator = None
        self._pool, self.pool_numel, self._own_storage, self._held = {}, 0, {}, None


def _key(buf: torch.Tensor) -> tuple:
    return buf.numel(), buf.dtype, buf.device


def _sole_owner(buf: torch.Tensor) -> bool:
    """True when no other tensor (e.g. a view saved for backward) shares ``buf``'s storage."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False  # cannot tell: never reuse
    return use_count(buf.untyped_storage()._cdata) <= 2  # ``buf`` + the temporary storage object
