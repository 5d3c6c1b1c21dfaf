"""The stage object's declared interface: what the engine, checkpoints and monitors may call.

``build_zero_stage`` (zero/build.py) returns one of two implementations: ``ReplicatedGradients``
(zero/stage0.py: fp32 stage 0, and engines without an optimizer below stage 3) and
``ZeroStage`` (zero/zero_stage.py: 16-bit stage 0 and stages 1-3). Both subclass ``StageInterface``,
so a missing member fails when the class is instantiated, not when a checkpoint first needs it.
Code outside ``zerotrain.zero`` reaches the stage object through ``engine.zero_stage_object``
and uses these members only (``tests/zero/test_stage_interface.py`` checks ``src/``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn


class TrainsModule(ABC):  # noqa: B024  # a declared kind, nothing to implement
    """An object that trains a module and exposes it as ``.module``: ``ZeroTrainEngine`` (and so
    the pipeline engine). Functions that accept an engine or a bare module
    (``zero.named_full_parameters``) tell the two apart by this type, not by probing attributes.
    It declares no abstract member: the engine keeps ``module`` as an ``nn.Module`` child, which a
    class-level property here would shadow."""

    module: nn.Module


@dataclass(frozen=True)
class ShardedState:
    """What a checkpoint saves and reloads of a stage, by parameter name.

    ``units``: the ``FlatParamUnit``s (trained and frozen; each with ``names``, ``layout``,
    ``shard_values()``, ``master``, ``group``), empty where the module's own parameters are
    the training state (fp32 stage 0). ``shard_rank``: which shard of each unit this rank holds
    (``unit.layout.shard_pieces(shard_rank)``; 0 where shards are whole). ``optimizer_swapper``:
    the NVMe optimizer swapper holding the units' masters and optimizer state in swap files
    (``zerotrain.offload.swapper.OptimizerSwapper``), or None."""

    units: tuple = ()
    shard_rank: int = 0
    optimizer_swapper: object | None = None


@dataclass(frozen=True)
class GatherStatistics:
    """Stage 3's gathers of partitioned units (``zero.stage3.ParameterCoordinator``), now.

    ``gathered_bytes``: full parameter buffers gathered now; ``peak_gathered_bytes``: the most
    gathered at once so far; ``pool_bytes``: released buffers kept for the next gather of their
    size; ``buffers_allocated``: full buffers allocated for gathers so far (not reused);
    ``pool_drops``: backwards that began by dropping the pool (``memory_release: "eager"``);
    ``early_releases``: frozen units released when their module's backward ended;
    ``hollowed``: tied units emptied while only embeddings still used them; ``storage_refills``:
    gathers into such an emptied storage."""

    gathered_bytes: int = 0
    peak_gathered_bytes: int = 0
    pool_bytes: int = 0
    buffers_allocated: int = 0
    pool_drops: int = 0
    early_releases: int = 0
    hollowed: int = 0
    storage_refills: int = 0


@dataclass(frozen=True)
class StageStatistics:
    """What a stage reports about itself (``StageInterface.statistics``).

    ``memory``: bytes this rank holds, by category, counted from the tensors actually held
    (``parameters``, ``master_parameters``, ``gradients``, ``optimizer_state``,
    ``communication_buffers``; with offload ``offload_buffers``; at stage 3
    ``gathered_parameters``, ``peak_gathered_parameters``, ``gather_pool``): what
    ``engine.memory_breakdown()`` reports. ``offload``: NVMe offload's last step, empty without
    it (``zero.nvme.SwapStatistics``: ``bytes_read``, ``bytes_written``, ``io_wait_s``,
    ``step_s``, ``io_busy_s``, the swap footprint, and ``params``/``grads`` with parameter
    offload). ``gathers``: stage 3's ``GatherStatistics``, None below it."""

    memory: dict[str, int]
    offload: dict = field(default_factory=dict)
    gathers: GatherStatistics | None = None


class StageInterface(ABC):
    """The training state of a module's parameters for one ZeRO stage, driven by the engine."""

    @property
    @abstractmethod
    def stage(self) -> int:
        """The ZeRO stage this object implements (0-3)."""

    # -- backward: gradients are reduced across the group while backward runs ------------
    @abstractmethod
    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        """A backward pass starts; it ends an accumulation window when ``boundary``, and
        reduces nothing inside ``engine.no_sync()`` (``no_sync``)."""

    @abstractmethod
    def end_backward(self) -> None:
        """The backward pass returned: wait for its reductions."""

    @abstractmethod
    def abort_backward(self) -> None:
        """The backward pass raised: drop its pending reductions and hooks' state."""

    @abstractmethod
    def accumulated_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """Where ``param``'s gradient accumulates in the current accumulation window, before
        the window's reduction over the data group: a view of the stage's gradient buffer
        (fp32 with 16-bit parameters and ``grad_accum_dtype: fp32``, where ``param.grad`` stays
        None), else ``param.grad`` (zeros where no backward reached it yet). Editing it in place
        edits what the reduction reduces (the pipeline engine sums tied copies through it).
        None for a parameter that takes no gradient; valid from the window's first backward to
        its reducing one."""

    # -- step ---------------------------------------------------------------------------
    @abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """fp32 L2 norm of the whole reduced gradient: over every unit's group and the ranks
        holding distinct parameters (pipeline stages, model slices), each element counted once;
        the same on every rank, inf/NaN where any of them overflowed. Collective."""

    @abstractmethod
    def set_gradient_divide_factor(self, factor: float, units=None) -> None:
        """Divide the reduced gradient sums by ``factor`` instead of each unit's group size
        (1 sums); ``units``: the ``sharded_state().units`` to set it for (None: all)."""

    @abstractmethod
    def step(self, optimizer, grad_scale: float = 1.0) -> None:
        """Update the weights from the gradients multiplied by ``grad_scale``."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Zero the gradients (they stay in their buffers)."""

    # -- whole-model weights and checkpoint state ----------------------------------------
    @abstractmethod
    def load_module_state(self, module: nn.Module, state_dict, strict: bool = True):
        """Whole-model weights into the training state; ``(missing, unexpected)`` keys."""

    @property
    @abstractmethod
    def parameter_coordinator(self):
        """Stage 3's ``ParameterCoordinator`` (gathers partitioned parameters), else None."""

    @abstractmethod
    def sharded_state(self) -> ShardedState:
        """The units, shard rank and swapper checkpoints read and write (``ShardedState``)."""

    # -- offload_states / empty_partition_cache --------------------------------------------
    @abstractmethod
    def state_tensors(self, module: nn.Module, optimizer) -> dict[str, list[torch.Tensor]]:
        """This rank's training state by ``OffloadStateTypeEnum`` value (``optim_states``,
        ``hp_params``, ``lp_params``, ``lp_grads``, ``contiguous_grad_buffer``): the tensors
        whose storages ``engine.offload_states`` moves (zero/offload_states.py). Raises where
        the state lives in NVMe swap files."""

    @abstractmethod
    def empty_partition_cache(self) -> None:
        """Release every gathered full parameter buffer kept beyond its use (stage 3: the unit
        kept from forward into backward, prefetched units, the buffer pool); a no-op below
        stage 3. Not during a backward."""

    # -- accounting and teardown ---------------------------------------------------------
    @abstractmethod
    def statistics(self, module: nn.Module, optimizer) -> StageStatistics:
        """This rank's bytes by category, NVMe offload's last step and stage 3's gathers
        (``StageStatistics``)."""

    @abstractmethod
    def close(self) -> None:
        """Remove hooks and patches; the module is a plain module again."""
