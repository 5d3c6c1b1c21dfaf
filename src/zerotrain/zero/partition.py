"""Partitioned parameters: ``FlatParamUnit``, the unit of ZeRO's 16-bit stage 0 and stages 1-3.

The trainable parameters of each optimizer param group are split into *units* of at most
``unit_numel`` elements. A unit's parameters are flattened into one buffer (padded so it divides
by ``world_size * align``) and each module parameter becomes a view into it. Rank ``r`` owns the
r-th contiguous shard of every unit; the optimizer works on those shards, which are views of
the same buffer, so in fp32 no second "master" copy exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerotrain.comm import collectives
from zerotrain.precision.masters import adopt_changed as _adopt_changed
from zerotrain.zero.flat import FlatLayout
from zerotrain.zero.leaves import unit_parameters

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from zerotrain.offload.params import ParamSwapper
    from zerotrain.zero.stage3 import ParameterCoordinator


def shard_alignment(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: shards start 16-byte aligned, as vectorised kernels and NCCL like."""
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


class FlatParamUnit:
    """Parameters flattened into one buffer; this rank's shard is an ``nn.Parameter``.

    Normally the shard is a view of the full buffer. After ``reshard()`` (stage 3) the shard is
    the only storage kept: the full buffer exists only between ``start_gather``/``finish_gather``
    and ``release``, and the module parameters are empty placeholders otherwise. A resharded
    unit trained in 16 bits with its fp32 master beside it can drop even the shard
    (``derive_shard_from_master``): it is the master rounded, so gathers cast the master.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        world_size: int,
        rank: int,
        dtype: torch.dtype | None = None,
        names: Sequence[str] | None = None,
        group: int | None = None,
    ):
        # ``dtype``: what the buffer will hold after ``cast`` (shards are aligned for it).
        self.params = list(params)
        # The parameters' names in the module (first name of a tied parameter), and the
        # optimizer param group that steps the unit (None: frozen, nothing steps it).
        self.names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
        self.group = group
        align = shard_alignment(dtype or self.params[0].dtype)
        self.layout = FlatLayout(self.params, world_size, align)
        # The full buffer: None while released (stage 3, between gathers).
        flat = self.layout.empty()
        self.flat: torch.Tensor | None = flat
        with torch.no_grad():
            self.layout.copy_in(flat, self.params)
        self._point_params_at(flat)
        self._rank = rank
        # None once derived from the fp32 master (``derive_shard_from_master``).
        self.shard: nn.Parameter | None = nn.Parameter(self.layout.shard(flat, rank))
        self.record_versions()

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def shard_rank(self) -> int:
        """This rank's index among the ranks the unit is sharded over (whose shard it keeps)."""
        return self._rank

    @property
    def trained(self) -> bool:
        return self.group is not None

    def named_slots(self):
        """``(name, ParamSlot)`` of every parameter: where it lives in the flat buffer."""
        return list(zip(self.names, self.layout.slots))

    @property
    def gathered(self) -> bool:
        return self.flat is not None

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (of the shard, whether kept or derived from the master)."""
        return self.layout.dtype

    @property
    def device(self) -> torch.device:
        if self.shard is None:
            assert self.master is not None, "a derived shard has an fp32 master"
            return self.master.device
        return self.shard.device

    @property
    def derived(self) -> bool:
        """Whether the 16-bit shard is not kept but cast from the fp32 master when needed."""
        return self.shard is None

    @property
    def shard_derivable(self) -> bool:
        """Whether the shard can be dropped: resharded, with an fp32 master beside it on the
        device its gathers fill (a master on a GPU's host keeps it: a gather would move fp32
        across the bus), and not swapped to NVMe."""
        return (
            self.resharded
            and self.master is not None
            and self.param_swapper is None
            and self.shard is not None
            and self.master.device == self.layout.device == self.shard.device
        )

    def derive_shard_from_master(self) -> None:
        """Free the 16-bit shard (see ``shard_derivable``): after every step and every load it
        equals the master rounded, so a gather casts the master's slice straight into the gather
        buffer instead (16-bit stage 3 keeps 2 bytes per shard element less, and the step copies
        nothing back)."""
        if not self.shard_derivable:
            raise ValueError(
                "only a resharded unit with an fp32 master beside its shard, on "
                "the device its gathers fill, can derive its shard from the master"
            )
        self.shard = None

    def shard_values(self) -> torch.Tensor:
        """This rank's shard in the parameters' dtype, to read (a new tensor when derived)."""
        if self.derived:
            return self._derived_from().to(self.dtype)
        return self.resident_shard().detach()

    def _derived_from(self) -> torch.Tensor:
        """The fp32 master a derived shard is cast from (detached)."""
        assert self.master is not None, "a derived shard has an fp32 master"
        return self.master.detach()

    def cast(self, dtype: torch.dtype) -> None:
        """Move the buffers (and so every module parameter) to ``dtype``, freeing the old ones."""
        if dtype == self.dtype:
            return
        self.layout = self.layout.with_dtype(dtype)
        if self.resharded:
            assert self.shard is not None, "cast before the shard is derived"
            self.shard = nn.Parameter(self.shard.detach().to(dtype))
            return
        flat = self.full_buffer()
        self.flat = flat = flat.to(dtype)
        self._point_params_at(flat)
        self.shard = nn.Parameter(self.layout.shard(flat, self._rank))

    def all_gather(self, group=None):
        """Start gathering every rank's updated shard into the full buffer."""
        assert self.shard is not None, "a whole unit keeps its shard"
        return collectives.all_gather_into(self.full_buffer(), self.shard.detach(), group=group, async_op=True)

    def full_buffer(self) -> torch.Tensor:
        """The full buffer, where the caller knows it is held (whole or gathered)."""
        assert self.flat is not None, "the unit's full buffer is released"
        return self.flat

    # -- stage 3 ------------------------------------------------------------------------
    resharded = False
    coordinator: ParameterCoordinator | None = None  # the coordinator that gathers it (stage 3)
    master: torch.Tensor | None = None  # the optimizer's fp32 copy of the shard, in 16 bits
    param_swapper: ParamSwapper | None = None  # offload_param "nvme"
    shard_edited = False  # the shard was written outside the step (NVMe offload adopts it)
    process_group: ProcessGroup | None = None  # the data-parallel group its shards are spread over
    _ds_status = False  # whether the parameters carry DeepSpeed's ds_status

    def expose_deepspeed_attributes(self, ids) -> None:
        """DeepSpeed's public ``ds_*`` read-outs on each parameter (see zero.registry)."""
        from zerotrain.zero.param_status import ZeroParamStatus
        from zerotrain.zero.parameter_offload import ActiveSubModules

        self._status = ZeroParamStatus
        self._ds_status = True
        pieces = {piece.slot.index: piece for piece in self.layout.shard_pieces(self._rank)}
        # Views of the shard's storage (refilled in place); of the fp32 master where the shard
        # is derived from it.
        shard = self._derived_from() if self.derived else self.resident_shard().detach()
        for i, (param, slot) in enumerate(zip(self.params, self.layout.slots)):
            p: Any = param  # DeepSpeed's ds_* read-outs are attributes set on torch's Parameter
            p.ds_id = next(ids)
            p.ds_numel = slot.numel
            p.ds_shape = slot.shape
            piece = pieces.get(i)
            p.ds_tensor = shard.narrow(0, piece.shard_start, piece.numel) if piece else shard.narrow(0, 0, 0)
            p.ds_active_sub_modules = ActiveSubModules(self)
            # DeepSpeed's method (Lightning's stage-3 model summary calls it): this rank's part.
            p.partition_numel = p.ds_tensor.numel
        self._set_status(self.gathered)

    def _set_status(self, available: bool) -> None:
        if self._ds_status:
            status = self._status.AVAILABLE if available else self._status.NOT_AVAILABLE
            for param in self.params:
                p: Any = param  # ds_status: an attribute set on torch's Parameter
                p.ds_status = status

    def resident_shard(self, dirty: bool = False, fill: bool = True) -> torch.Tensor:
        """The shard, in memory (with NVMe parameter offload it may have been evicted to its
        swap file: read back now, unless ``fill`` is False: the caller overwrites all of it).
        ``dirty``: the caller writes it (so it is written back)."""
        if self.derived:
            raise RuntimeError(
                "this unit's shard is derived from its fp32 master: read shard_values(), write the master"
            )
        if self.param_swapper is not None:
            return self.param_swapper.ensure(self, dirty, fill)
        assert self.shard is not None  # not derived
        return self.shard

    @torch.no_grad()
    def adopt_full_values(self) -> None:
        """The gathered full buffer was changed in place: make this rank's shard (and master)
        match it."""
        new = self.layout.shard(self.full_buffer(), self._rank)
        if not self.derived:
            self.resident_shard(dirty=True).data.copy_(new)
            self.shard_edited = True
        if self.master is not None:
            _adopt_changed(self.master.data, new)

    # -- edits made outside the optimizer -------------------------------------------------
    def edited_since_recorded(self) -> bool:
        """Whether a parameter was written in place, or the shard outside the step, since
        ``record_versions``."""
        return self.shard_edited or any(p._version != v for p, v in zip(self.params, self._versions))

    def record_versions(self) -> None:
        """Remember each parameter's version counter (bumped by every in-place write through
        the parameter: ``copy_``, ``load_state_dict``, ``nn.init``, EMA updates under no_grad)."""
        self._versions = [p._version for p in self.params]
        self.shard_edited = False

    @torch.no_grad()
    def adopt_edits(self) -> None:
        """Copy parameters edited in place since ``record_versions`` (this rank's part of them)
        into the fp32 master, so the next step starts from the edited weights. (The step's own
        writes go to the shard and master, never through the parameters, so they bump nothing.)"""
        edited = {i for i, (p, v) in enumerate(zip(self.params, self._versions)) if p._version != v}
        if not edited:
            return
        if self.master is not None and not self.resharded:
            full = self.layout.shard(self.full_buffer(), self._rank)
            for piece in self.layout.shard_pieces(self._rank):
                if piece.slot.index in edited:
                    window = slice(piece.shard_start, piece.shard_start + piece.numel)
                    _adopt_changed(self.master.data[window], full[window])
        self.record_versions()

    @torch.no_grad()
    def load_values(self, values: Sequence[torch.Tensor | None]) -> None:
        """Set parameters from whole tensors (one per parameter, None to keep): this rank's
        shard and, exactly from ``values``' precision, the fp32 master; whole buffers too."""
        if not self.resharded:  # whole: the parameters are views of the buffer the shard is in
            for p, value in zip(self.params, values):
                if value is not None:
                    p.copy_(value)
        kept = self.resharded and not self.derived
        targets = ([self.resident_shard(dirty=True).data] if kept else []) + (
            [] if self.master is None else [self.master.data]
        )
        for piece in self.layout.shard_pieces(self._rank):
            value = values[piece.slot.index]
            if value is not None:
                src = value.reshape(-1).narrow(0, piece.param_start, piece.numel)
                for target in targets:
                    target.narrow(0, piece.shard_start, piece.numel).copy_(src)
        self.record_versions()
        self.shard_edited = self.master is None  # no master written here: adopt at the step

    def reshard(self) -> None:
        """Keep only this rank's shard (a private copy) and free the full buffer."""
        self.shard = nn.Parameter(self.layout.shard(self.full_buffer(), self._rank).clone())
        self.resharded = True
        self.release()  # the construction-time buffer is freed, not pooled

    def release(self) -> torch.Tensor | None:
        """Drop the full buffer; module parameters become empty placeholders. Returns the
        buffer (for a pool to reuse once nothing else, e.g. autograd, still refers to it)."""
        # Placeholders on the device the module computes on (not the shard's: host memory under
        # offload_param), so ``next(model.parameters()).device`` still names it.
        empty = torch.empty(0, dtype=self.dtype, device=self.layout.device)
        for p in self.params:
            p.data = empty
        flat, self.flat = self.flat, None
        self._set_status(False)
        return flat

    def start_gather(self, group=None, buffer: torch.Tensor | None = None, identity=None):
        """Start gathering the shards into ``buffer`` (``layout.padded_numel`` elements of the
        shard's dtype), or into a newly allocated full buffer. ``identity``: what every rank
        must be gathering too (``collectives.Identity``, checked when the gather is waited for)."""
        self.flat = flat = buffer if buffer is not None else self.layout.empty(zero=False)
        if self.derived:  # this rank's slice of the buffer is the input: nothing else to copy
            shard = self.layout.shard(flat, self._rank)
            shard.copy_(self._derived_from())
            return collectives.all_gather_into(flat, shard, group=group, async_op=True, identity=identity)
        shard = self.resident_shard().detach()
        if shard.device != flat.device:  # offload_param: the shard lives in host memory
            shard = shard.to(flat.device, non_blocking=True)
        return collectives.all_gather_into(flat, shard, group=group, async_op=True, identity=identity)

    def attach(self, buffer: torch.Tensor) -> None:
        """Point the module parameters at ``buffer`` as it is, unfilled (stage 3: a storage of 0
        bytes gives them their shapes for a backward that reads no weights)."""
        self.flat = buffer
        self._point_params_at(buffer)

    def finish_gather(self) -> None:
        """After the gather has completed: point the module parameters at the full buffer."""
        self._point_params_at(self.full_buffer())

    def _point_params_at(self, flat: torch.Tensor) -> None:
        for p, view in zip(self.params, self.layout.views(flat)):
            p.data = view
        self._set_status(True)


def plan_units(
    param_groups: Sequence[dict], unit_numel: int, backward_order: Sequence[nn.Parameter]
) -> list[tuple[int, list[nn.Parameter]]]:
    """Split each param group's trainable parameters into units, ordered by when backward is
    expected to complete them.

    Parameters are walked in ``backward_order``; each goes into its group's open unit, and a
    unit closes when adding the next parameter would exceed ``unit_numel``. Units are then sorted
    by the position of their last parameter, so a unit mixing early and late parameters (say all
    biases of a no-decay group) does not hold back the reduction of units that finish before it.
    """
    group_of: dict[int, int] = {}
    for g, group in enumerate(param_groups):
        for p in group["params"]:
            if id(p) in group_of:
                raise ValueError("a parameter appears in more than one optimizer param group")
            group_of[id(p)] = g
    units: list[tuple[int, list[nn.Parameter], int]] = []
    open_unit: dict[int, tuple[list[nn.Parameter], int, int]] = {}
    for position, p in enumerate(backward_order):
        owner = group_of.get(id(p))
        if owner is None or not p.requires_grad:
            continue
        params, size, index = open_unit.get(owner, (None, 0, -1))
        if params is None or (params and size + p.numel() > unit_numel):
            params, size, index = [], 0, len(units)
            units.append((owner, params, position))
        params.append(p)
        units[index] = (owner, params, position)
        open_unit[owner] = (params, size + p.numel(), index)
    in_model = {id(p) for p in backward_order}
    missing = [p for group in param_groups for p in group["params"] if p.requires_grad and id(p) not in in_model]
    if missing:
        raise ValueError(
            f"{len(missing)} optimizer parameters are not parameters of the model "
            "passed to initialize(); ZeRO can only partition the model's parameters"
        )
    units.sort(key=lambda u: u[2])
    return [(g, params) for g, params, _ in units]


def outside_optimizer(param_groups: Sequence[dict], module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of ``module`` that no optimizer param group holds (DDP still averages
    their gradients; nothing steps them)."""
    held = {id(p) for group in param_groups for p in group["params"]}
    out, seen = [], set()
    for p in module.parameters():
        if p.requires_grad and id(p) not in held and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def plan_module_units(
    param_groups: Sequence[dict],
    module: nn.Module,
    frozen: bool = True,
    all_frozen: bool = False,
    leaf_of: dict | None = None,
) -> list[tuple[int | None, list[nn.Parameter]]]:
    """Stage 3's units: each module's own parameters (per param group), so a unit is gathered
    exactly when its module runs; a leaf module's (``leaf_of``: module -> its outermost leaf,
    zero/leaves.py) whole subtree instead. Modules are walked in reverse registration order,
    which approximates the order backward completes them; a parameter shared by several modules
    (tied weights) belongs to the first module that registers it (or that module's leaf). With
    ``frozen``, parameters that do not require gradients (every parameter, with ``all_frozen``:
    an engine without optimizer) form units of group None, partitioned too; nothing steps them."""
    leaf_of = leaf_of or {}
    group_of: dict[int, int | None] = {id(p): g for g, group in enumerate(param_groups) for p in group["params"]}
    for p in module.parameters():
        if all_frozen or not p.requires_grad:  # frozen even if an optimizer group lists it
            if frozen:
                group_of[id(p)] = None
            else:
                group_of.pop(id(p), None)
    first_owner: dict[int, nn.Module] = {}
    for m in module.modules():
        for owned in m._parameters.values():
            if owned is not None:
                first_owner.setdefault(id(owned), leaf_of.get(m, m))
    units = []
    for m in reversed(list(module.modules())):
        params = unit_parameters(m, leaf_of)
        if params is None:
            continue  # inside a leaf: part of the leaf's unit
        by_group: dict[int | None, list[nn.Parameter]] = {}
        for p in params:
            if first_owner[id(p)] is not m or id(p) not in group_of:
                continue
            by_group.setdefault(group_of[id(p)], []).append(p)
        units.extend(sorted(by_group.items(), key=lambda kv: -1 if kv[0] is None else kv[0]))
    return units
