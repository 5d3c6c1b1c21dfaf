"""The training engine returned by ``zerotrain.initialize``.

It wraps the user's module, optimizer and LR scheduler. The step bookkeeping (micro-steps,
accumulation boundaries, global steps and samples, the training state, clipping, overflow skips,
the LR scheduler, the step log) is the step core's (``self._core``, engine/step_core.py), which
the pipeline engine holds too. What each ZeRO stage holds and how it reduces gradients lives in
the stage object (``self._zero``, a ``zerotrain.zero.interface.StageInterface``); the engine only
drives it, through that interface.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from zerotrain.accelerator import get_accelerator
from zerotrain.checkpoint import full_state_dict, save_16bit_model
from zerotrain.comm.distributed import get_local_rank
from zerotrain.comm.logger import release as release_comms_logger
from zerotrain.engine.accessors import EngineAccessors
from zerotrain.engine.checkpoints import EngineCheckpointing
from zerotrain.engine.flops import EngineFlops
from zerotrain.engine.optimizer_surface import OptimizerSurface
from zerotrain.engine.plain_backward import PlainBackward
from zerotrain.engine.state_offload import EngineStateOffload
from zerotrain.engine.step_core import StepCore, StepOutcome, StepSettings, TrainingState
from zerotrain.engine.timers import BACKWARD, BACKWARD_INNER, BACKWARD_REDUCE, FORWARD, StepTimers
from zerotrain.experts.stats import MoEStats
from zerotrain.monitor import MonitorMaster
from zerotrain.monitor.memory import register_engine, unregister_engine
from zerotrain.pld.engine import EnginePLD
from zerotrain.precision import PrecisionPolicy, autocast, build_loss_scaler
from zerotrain.topology import Topology
from zerotrain.topology.process_wide import reset as reset_current_topology
from zerotrain.zero import build_zero_stage
from zerotrain.zero.interface import StageInterface, TrainsModule


class ZeroTrainEngine(
    EngineCheckpointing, EngineStateOffload, EngineAccessors, EnginePLD, EngineFlops, nn.Module, TrainsModule
):
    """Drives training: ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``."""

    def __init__(
        self,
        module: nn.Module,
        config,
        optimizer=None,
        lr_scheduler=None,
        training_dataloader=None,
        data_parallel_group=None,
        topology=None,
    ):
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self._config = config
        self.accelerator = get_accelerator()
        self.local_rank = get_local_rank()
        # Every rank and group this engine uses comes from its topology (zerotrain.topology).
        self.topology = topology if topology is not None else Topology.from_group(data_parallel_group)
        self.global_rank = self.topology.global_rank
        # None for the whole world (torch's default group): the engine holds no reference to it.
        self.data_parallel_group = self.topology.collective_group("data")
        self.dp_world_size = self.topology.data_size
        self.device = self.accelerator.device(self.local_rank)
        self.precision = PrecisionPolicy.from_config(config, self.device)
        _check_device_supports(self.precision, self.device)
        if self.precision.autocast_dtype is not None:
            autocast.check_device(self.device, self.precision.autocast_dtype)
            autocast.resolve_safe_modules(autocast.safe_module_names(config.torch_autocast))
        self.loss_scaler = build_loss_scaler(config, self.precision)
        # The gradient norm and the overflow decision span the data group and the ranks holding
        # distinct parameters beside it (pipeline stages, model slices).
        self._zero = build_zero_stage(
            config,
            module,
            optimizer,
            self.precision,
            group=self.data_parallel_group,
            norm_group=self.topology.distinct_group,
            topology=self.topology,
        )
        self._timers = StepTimers(self.accelerator, bool(config.wall_clock_breakdown))
        # The data group's first rank writes; closed by destroy() or at exit.
        self.monitor = MonitorMaster(config, topology=self.topology)
        register_engine(self)  # weakly, for zerotrain.memory_status()
        self._moe_stats = MoEStats.attach(module, self.data_parallel_group)  # None without MoE layers
        self._init_pld()  # progressive layer dropping (zerotrain.pld)
        self._init_flops_profiler()  # the flops_profiler section (zerotrain.engine.flops)
        # loss.backward() on the forward's outputs (engine/plain_backward.py)
        self._plain_backward = PlainBackward(self)
        # offload_states, step, overflow on the optimizer, as on DeepSpeed's (engine/optimizer_surface.py)
        self._optimizer_surface = OptimizerSurface(self, optimizer)
        # counters, boundary, training state, the model step and its log (engine/step_core.py)
        self._core = StepCore(
            self,
            StepSettings.from_config(config),
            zero=self._zero,
            loss_scaler=self.loss_scaler,
            check_overflow=self.precision.check_overflow,
            optimizer_surface=self._optimizer_surface,
            timers=self._timers,
            monitor=self.monitor,
            topology=self.topology,
            moe_stats=self._moe_stats,
        )

    # -- attributes fall back to the wrapped module, as DeepSpeed's engine does ---------
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise

    # -- the step core's counters and state, under DeepSpeed's names ---------------------
    # Attributes (checkpoints and frameworks assign them); the values live in the core.
    global_steps = property(
        lambda self: self._core.global_steps, lambda self, v: setattr(self._core, "global_steps", v)
    )
    global_samples = property(
        lambda self: self._core.global_samples, lambda self, v: setattr(self._core, "global_samples", v)
    )
    micro_steps = property(lambda self: self._core.micro_steps, lambda self, v: setattr(self._core, "micro_steps", v))
    skipped_steps = property(
        lambda self: self._core.skipped_steps, lambda self, v: setattr(self._core, "skipped_steps", v)
    )

    @property
    def training_state(self) -> TrainingState:
        """Where the engine is in its loop (``zerotrain.engine.step_core.TrainingState``)."""
        return self._core.state

    @property
    def step_outcome(self) -> StepOutcome:
        """What the last ``step()`` did (``zerotrain.engine.step_core.StepOutcome``)."""
        return self._core.outcome

    # -- configuration accessors --------------------------------------------------------
    @property
    def config(self):
        """The validated zerotrain config (``ZeroTrainConfig``)."""
        return self._config

    def train_batch_size(self) -> int:
        return self._core.settings.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._core.settings.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._core.settings.accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self._zero.stage

    @property
    def zero_stage_object(self) -> StageInterface:
        """The stage object (``zerotrain.zero.interface.StageInterface``): what checkpoints and
        monitors read the sharded training state through. Use its interface members only; the
        concrete type (``ReplicatedGradients`` or ``ZeroStage``) depends on stage and precision."""
        return self._zero

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping  # as configured (the core reads None as 0.0)

    # -- training loop ------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        if self.precision.auto_cast:
            inputs, kwargs = _cast_floats((inputs, kwargs), self.precision.param_dtype)
        kwargs.update(self._pld_forward_kwargs())  # while training, as DeepSpeed
        self._plain_backward.settle()
        self._require_states("engine forward", forward=True)
        profiling = self._flops_forward_begin()
        self._timers.start(FORWARD)
        try:
            with (
                self._core.phase(TrainingState.FORWARD),
                autocast.forward_context(self.precision.autocast_dtype, self.device),
            ):
                # Outputs whose backward the engine notices when it did not start it.
                return self._plain_backward.wrap_outputs(self.module(*inputs, **kwargs))
        finally:
            self._timers.stop(FORWARD)
            if profiling:
                self._flops_forward_end()

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step ends an accumulation window."""
        return self._core.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary decision (for loops that end a window early)."""
        self._core.boundary_override = bool(is_boundary)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True, release_loss: bool = False
    ) -> torch.Tensor:
        """Backpropagate ``loss`` (divided by the accumulation steps); gradients are reduced
        across ranks during this call when it ends an accumulation window. ``loss.backward()``
        on the engine's outputs does the same (engine/plain_backward.py)."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward(loss) needs a scalar loss tensor")
        self._require_states("engine.backward()")
        core = self._core
        factor = core.backward_factor(scale_wrt_gas=scale_wrt_gas)
        scaled = loss if factor == 1.0 else loss.float() * factor
        self._plain_backward.begin_explicit()
        try:
            with core.phase(TrainingState.BACKWARD):
                self._timers.start(BACKWARD)
                self._zero.begin_backward(core.is_boundary(), core.in_no_sync)
                self._timers.start(BACKWARD_INNER)
                try:
                    scaled.backward(retain_graph=retain_graph)
                except BaseException:
                    self._zero.abort_backward()
                    raise
                self._timers.stop(BACKWARD_INNER)
                self._timers.start(BACKWARD_REDUCE)
                self._zero.end_backward()
                self._timers.stop(BACKWARD_REDUCE)
                self._timers.stop(BACKWARD)
        finally:
            self._plain_backward.end_explicit()
        core.record_loss(loss)
        # release_loss: hand back a loss that keeps no graph (DeepSpeed accepts the flag and
        # does nothing with it; with retain_graph=True this lets the caller drop the graph).
        return loss.detach() if release_loss else loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (fp32/bf16: ``loss`` itself), for a manual
        ``engine.scale(loss).backward()``: the engine's outputs still divide by the accumulation
        steps, so it equals ``engine.backward(loss)``. Needed with dynamic fp16 loss scaling,
        where a bare ``loss.backward()`` raises."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.scale(loss) needs a scalar loss tensor")
        self._core.record_loss(loss)
        return self._plain_backward.scale(loss)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Update the weights at an accumulation boundary; otherwise only count the micro-step."""
        core = self._core
        core.check_can_step()
        core.outcome = StepOutcome.ACCUMULATED
        self._plain_backward.settle()
        self._require_states("engine.step()")
        if core.is_boundary():
            self._pld_at_boundary()  # theta(global_steps), before the step counts
            core.model_step(lr_kwargs)
            self._flops_step_done()  # prints the profile at the end of the profiled step
            core.log_step()
        core.count_micro_steps()

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.loss_scaler.loss_scale

    def zero_grad(self) -> None:  # type: ignore[override]  # DeepSpeed's engine.zero_grad() takes no set_to_none
        """Zero the gradients (they stay in their flat buffers)."""
        self._plain_backward.settle()
        self._zero.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally without reducing them across ranks.

        Works at every ZeRO stage: the next backward outside the block reduces everything
        accumulated so far. ``step()`` inside the block is an error."""
        with self._core.no_sync():
            yield

    # -- state accessors ----------------------------------------------------------------
    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` call updated the weights."""
        return self._core.outcome is StepOutcome.APPLIED

    def get_global_grad_norm(self) -> float | None:
        """Gradient norm of the whole model at the last update, over every rank holding a part
        of it (data shards, pipeline stages, model slices); None unless clipping is on."""
        return self._core.global_grad_norm

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list:
        if self.optimizer is None:
            return []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in self.optimizer.param_groups]

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds, by category, counted from the tensors actually held
        (``offloaded_states``: host buffers of ``offload_states()``, while there are any)."""
        out = dict(self._zero.statistics(self.module, self.optimizer).memory)
        offloaded = self._offloaded_nbytes()
        if offloaded:
            out["offloaded_states"] = offloaded
        return out

    def wall_clock_breakdown(self) -> dict[str, float]:
        """Milliseconds per phase since the last report (with ``wall_clock_breakdown: true``)."""
        return self._timers.pop()

    def module_state_dict(
        self, destination=None, prefix: str = "", keep_vars: bool = False, exclude_frozen_parameters: bool = False
    ):
        """The module's weights in the training dtype, as ``nn.Module.state_dict``.

        At stage 3 partitioned parameters are gathered (collective: every rank must call it)
        into CPU copies returned on rank 0 (other ranks get an empty dict), as DeepSpeed does;
        ``keep_vars=True`` is refused there, since the parameters themselves are placeholders."""
        coordinator = self._zero.parameter_coordinator
        if coordinator is None:
            state = self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
            if exclude_frozen_parameters:
                frozen = {
                    prefix + n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad
                }
                state = type(state)((k, v) for k, v in state.items() if k not in frozen)
        else:
            if keep_vars:
                raise ValueError(
                    "module_state_dict(keep_vars=True) at ZeRO stage 3: the "
                    "parameters are partitioned placeholders; use keep_vars=False "
                    "for gathered copies"
                )
            gathered = full_state_dict(
                self.module, coordinator, exclude_frozen_parameters, group=self.data_parallel_group
            )
            state = {prefix + k: v for k, v in gathered.items()}
        if destination is not None:
            destination.update(state)
            return destination
        return state

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """DeepSpeed's stage-3 gathered weights, by the name transformers' Trainer and accelerate
        call: ``module_state_dict()`` on rank 0, None on other ranks; ValueError below stage 3."""
        if self._zero.parameter_coordinator is None:
            raise ValueError("_zero3_consolidated_16bit_state_dict requires ZeRO stage 3")
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        first = self.topology.is_first("data")  # of this engine's group
        return state if first else None

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """DeepSpeed's general name for the gathered weights (accelerate, OpenRLHF): stage 3's
        ``_zero3_consolidated_16bit_state_dict``; ValueError otherwise, as DeepSpeed without
        tensor parallelism."""
        if self._zero.parameter_coordinator is None:
            raise ValueError(
                "_consolidated_16bit_state_dict applies where weights are partitioned (ZeRO stage 3); "
                "below it use engine.module_state_dict()"
            )
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def load_state_dict(self, state_dict, strict: bool = True):  # type: ignore[override]  # no assign: loads into the shards
        """Load whole-model weights (``module_state_dict()`` keys, or this engine's
        ``state_dict()`` keys with their ``module.`` prefix) into the training state on every
        rank: parameters, their shards, and the fp32 master weights (from the given tensors'
        own precision). Every rank passes the same state dict; no collective is issued.
        Returns ``(missing_keys, unexpected_keys)`` like ``nn.Module.load_state_dict``."""
        return self._zero.load_module_state(self.module, state_dict, strict)

    def save_16bit_model(
        self, save_dir, save_filename: str = "model.safetensors", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Write the whole model in its training dtype from rank 0 (every rank must call this).

        At stage 3 it needs ``stage3_gather_16bit_weights_on_model_save: true`` and raises
        otherwise (DeepSpeed silently returns False). ``*.safetensors`` names are written as
        safetensors, others with ``torch.save``. Returns True."""
        coordinator = self._zero.parameter_coordinator
        if coordinator is not None and not self._config.zero_optimization.gather_16bit_weights_on_model_save:
            raise ValueError(
                "save_16bit_model at ZeRO stage 3 gathers the partitioned weights, which "
                'needs "stage3_gather_16bit_weights_on_model_save": true in zero_optimization'
            )
        save_16bit_model(
            self.module, save_dir, save_filename, coordinator, exclude_frozen_parameters, group=self.data_parallel_group
        )
        return True

    def destroy(self) -> None:
        """Hand the module back as a plain ``nn.Module``: hooks and patches removed and, at
        stage 3, every parameter gathered whole (collective: call it on every rank). The
        module keeps the training dtype. The engine cannot train afterwards."""
        self.wait_for_checkpoint()  # an asynchronous save still writing
        self._zero.close()
        self._optimizer_surface.remove()
        self.monitor.close()
        if self._moe_stats is not None:
            self._moe_stats.close()
        reset_current_topology(self.topology)  # DeepSpeed's global getters no longer answer from it
        unregister_engine(self)  # memory reports no longer count it
        release_comms_logger(self._config)  # its hook is removed if this engine's config enabled it


def _cast_floats(tree, dtype: torch.dtype):
    """``fp16.auto_cast``: floating tensors in the inputs to the training dtype."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t, tree)


def _check_device_supports(precision: PrecisionPolicy, device: torch.device) -> None:
    """Fail at initialize, not with NaNs later, when the device cannot compute in the dtype."""
    if precision.param_dtype == torch.float32:
        return
    try:
        a = torch.ones(4, 4, dtype=precision.param_dtype, device=device)
        torch.nn.functional.layer_norm(a @ a, (4,))
    except RuntimeError as error:
        name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[precision.param_dtype]
        raise ValueError(
            f"{name} training was requested but {device} cannot compute in "
            f"{precision.param_dtype} ({error}); use the other 16-bit type or fp32"
        ) from None
