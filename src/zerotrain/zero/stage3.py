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
from zerotrain.zero.gather_buffers import GatherBuffers
from zerotrain.zero.interface import GatherStatistics
from zerotrain.zero.module_hooks import ModuleHooks
from zerotrain.zero.partition import FlatParamUnit
from zerotrain.zero.passes import UseOrder, before_backward_of, in_backward, output_tensors
from zerotrain.zero.stage3_backward import BackwardGathers

if TYPE_CHECKING:
    from zerotrain.zero.gradient_buckets import Pending


class ParameterCoordinator(BackwardGathers):
    """Fetches and releases the partitioned units of ``module``'s parameters around their use.

    Its parts: the modules it follows and the hooks on them (``ModuleHooks``, zero/module_hooks.py),
    the full buffers, pooled or emptied (``GatherBuffers``, zero/gather_buffers.py), and what it
    does as backward reaches each module (``BackwardGathers``, zero/stage3_backward.py)."""

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
        # The full buffers: pooled for reuse, or a unit's own storage emptied while released.
        self.buffers = GatherBuffers()
        self.pool_drops = 0  # backwards that began by dropping the pool ("eager")
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
        # Which modules the hooks follow, with the units each uses; parameters gathered on access.
        self.hooks = ModuleHooks(module, self._unit_of, leaf_of or {}, self.on_access)
        self._module_units = self.hooks.module_units
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
        self.hooks.register(self._pre_forward, self._post_forward)

    def remove_hooks(self) -> None:
        """Stop following forwards: what runs then (generation inside ``GatheredParameters``
        over the whole model) gathers nothing, and issues no collective."""
        self.hooks.remove()

    @property
    def hook_handles(self) -> list:
        """The forward hooks of ``register_hooks()`` (DeepSpeed's ``forward_hooks``)."""
        return self.hooks.handles

    @hook_handles.setter
    def hook_handles(self, handles: list) -> None:
        self.hooks.handles = handles

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
            else:
                self.buffers.keep(unit, flat, room=self.peak_live_numel - self.live_numel)

    # -- the buffers ------------------------------------------------------------------
    def _acquire(self, unit: FlatParamUnit) -> torch.Tensor:
        return self.buffers.acquire(unit, room=self.peak_live_numel - self.live_numel)

    def _drop_pool(self) -> None:
        self.buffers.drop_pool()

    @property
    def pool_nbytes(self) -> int:
        return self.buffers.pool_nbytes

    def gather_statistics(self) -> GatherStatistics:
        """The gathers' numbers now (``StageStatistics.gathers``)."""
        element = self.units[0].dtype.itemsize if self.units else 0
        return GatherStatistics(
            gathered_bytes=self.live_numel * element,
            peak_gathered_bytes=self.peak_live_numel * element,
            pool_bytes=self.buffers.pool_nbytes,
            buffers_allocated=self.buffers.buffers_allocated,
            pool_drops=self.pool_drops,
            early_releases=self.early_releases,
            hollowed=self.hollowed,
            storage_refills=self.buffers.storage_refills,
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
                    self.buffers.own_storage.pop(unit, None)
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
        self.hooks.unwrap_parameters()
        for u in self.units:
            u.coordinator = None
        self.buffers.clear()
        self._held = None
