"""Lightning: train a ``LightningModule`` on zerotrain with ``Trainer(strategy=ZeroTrainStrategy(...))``.

Lightning's own ``DeepSpeedStrategy`` already drives DeepSpeed through its public API
(``deepspeed.initialize``, ``engine.backward``/``step``, ``save_checkpoint``/``load_checkpoint``,
``zero.Init``), which zerotrain implements; with ``import deepspeed`` resolving to zerotrain
(``zerotrain.hf``'s alias) it runs unchanged wherever Lightning allows it, that is on CUDA.
:class:`ZeroTrainStrategy` is that strategy with what ties it to CUDA lifted, so the same
LightningModule trains on CPUs too (``Trainer(accelerator="cpu", devices=2, ...)``, gloo):

- Lightning refuses any accelerator but CUDA in ``setup_environment`` and checks the devices'
  CUDA indices in ``setup_distributed``; here the CPU passes both (other accelerators than CPU
  and CUDA are refused, naming them).
- Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` before the backward,
  and DeepSpeed's ``engine.backward`` divides it again (so with DeepSpeed, accumulation halves,
  thirds, ... the gradient against Lightning's DDP). Here the engine's backward leaves the loss
  as Lightning scaled it (``scale_wrt_gas=False``, DeepSpeed's switch for this), so gradients
  equal DDP's.

Everything else is Lightning's ``DeepSpeedStrategy`` code on zerotrain's engine: the config it
builds from the arguments (``stage=``, ``offload_optimizer=``, ... or ``config=`` a DeepSpeed/
zerotrain config dict or JSON path), ``gradient_accumulation_steps`` and ``gradient_clipping``
from the Trainer, ``precision`` ("32-true", "bf16-mixed", "16-mixed", ...) turned into the
config's ``bf16``/``fp16`` section by its precision plugin, the optimizer and scheduler from
``configure_optimizers``, checkpoints through ``engine.save_checkpoint``/``load_checkpoint``
(a directory with the Lightning state as ``client_state``), ``configure_model`` under
``zero.Init`` at stage 3.

Importing this module registers ``"zerotrain"`` and ``"zerotrain_stage_1"``/``_2``/``_3``
(and ``..._offload``: the optimizer, at stage 3 the parameters too, in CPU memory) with
Lightning's strategy registry, so ``Trainer(strategy="zerotrain_stage_2")`` works after it.

Needs the ``lightning`` extra (``pip install 'zerotrain[lightning]'``). See docs/hf.md, "Lightning".
"""

from __future__ import annotations

import sys

try:
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.strategies.ddp import DDPStrategy
    from lightning.pytorch.strategies.deepspeed import DeepSpeedStrategy
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("zerotrain.integrations.lightning needs Lightning: pip install 'zerotrain[lightning]'") from err

__all__ = ["ZeroTrainStrategy", "convert_zero_checkpoint_to_fp32_state_dict", "use_zerotrain_for_lightning"]


def use_zerotrain_for_lightning() -> None:
    """Make ``import deepspeed`` (and DeepSpeed's package metadata, which Lightning checks) resolve
    to zerotrain in this process and the processes it starts, for Lightning's DeepSpeed code.

    Unlike ``zerotrain.hf.use_zerotrain_as_deepspeed`` this does not refuse after transformers or
    accelerate were imported: Lightning asks for DeepSpeed only when its strategy is built. A real
    DeepSpeed already imported is refused (it would be the one Lightning's code calls)."""
    from zerotrain.hf.switch import is_active, put_shim_first

    if is_active():
        return
    current = sys.modules.get("deepspeed")
    if current is not None:
        raise RuntimeError(
            f"the real DeepSpeed is already imported ({getattr(current, '__file__', current)}): ZeroTrainStrategy "
            "runs Lightning's DeepSpeed code on zerotrain and needs `deepspeed` to be zerotrain in this process; "
            "use Lightning's DeepSpeedStrategy for the real DeepSpeed, or build ZeroTrainStrategy before importing it"
        )
    put_shim_first()


class ZeroTrainStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` on zerotrain, on CUDA and on CPUs.

    Takes ``DeepSpeedStrategy``'s arguments (``stage=2``, ``config=None``, ``offload_optimizer``,
    ``offload_parameters``, ``logging_level``, ...; ``config`` replaces the ones that build a
    config). Processes start as with Lightning's DDP and DeepSpeed strategies: the script is run
    again for every other rank of the machine (Lightning's "popen" launcher), or by ``torchrun``
    / a cluster that sets ``LOCAL_RANK``.
    """

    strategy_name = "zerotrain"

    def __init__(self, *args, **kwargs) -> None:
        use_zerotrain_for_lightning()  # DeepSpeedStrategy checks for and imports `deepspeed`
        super().__init__(*args, **kwargs)

    def setup_environment(self) -> None:
        # DeepSpeedStrategy's check allows CUDA only; zerotrain runs on CUDA and on the CPU.
        if not isinstance(self.accelerator, (CUDAAccelerator, CPUAccelerator)):
            raise RuntimeError(
                f"ZeroTrainStrategy runs on CUDA or CPU accelerators, not `{type(self.accelerator).__name__}`: "
                "pass Trainer(accelerator='cuda') or Trainer(accelerator='cpu')"
            )
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if self.root_device.type == "cuda":
            super().setup_distributed()  # also checks the CUDA device indices against the local ranks
            return
        # CPU devices carry no index to check; the rest is DeepSpeedStrategy's.
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        # Lightning has already divided the loss by accumulate_grad_batches: the engine must not
        # divide it again (DeepSpeedPrecision passes these keywords on to engine.backward).
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("zerotrain", cls, description="zerotrain (ZeRO stage 2)", override=True)
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"zerotrain_stage_{stage}",
                cls,
                override=True,
                description=f"zerotrain with ZeRO stage {stage}",
                stage=stage,
            )
            strategy_registry.register(
                f"zerotrain_stage_{stage}_offload",
                cls,
                override=True,
                stage=stage,
                offload_optimizer=True,
                offload_parameters=stage == 3,
                description=f"zerotrain with ZeRO stage {stage}, "
                f"optimizer{' and parameters' * (stage == 3)} in CPU memory",
            )


ZeroTrainStrategy.register_strategies(StrategyRegistry)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None) -> dict:
    """Lightning's function of this name (``lightning.pytorch.utilities.deepspeed``) for a
    checkpoint ``ZeroTrainStrategy`` saved: one file with the Lightning state and the whole fp32
    ``state_dict``, which ``LightningModule.load_from_checkpoint`` and
    ``ZeroTrainStrategy(stage=3, load_full_weights=True)`` read. Lightning's own function reads
    DeepSpeed's file layout, which zerotrain's checkpoints do not have. Returns what it wrote."""
    import torch

    from zerotrain.checkpoint.format import CheckpointReader, resolve_tag, state_file
    from zerotrain.checkpoint.training_state import read_rank_state
    from zerotrain.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder, tag = resolve_tag(checkpoint_dir, tag)
    # Lightning saves its state (loops, callbacks, schedulers, epoch) as the engine's client state.
    checkpoint = dict(read_rank_state(CheckpointReader(folder), state_file(0))["client_state"])
    checkpoint["state_dict"] = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    torch.save(checkpoint, output_file)
    return checkpoint
