"""Lightning runs for tests/integrations/test_lightning.py, in one launch of 2 CPU processes.

``python lightning_runs.py OUT`` starts as rank 0; its first ``Trainer.fit`` (devices=2) makes
Lightning start this script again as rank 1 (its "popen" launcher), and both processes then run
every fit below in turn (later fits find the ranks already started). Each rank saves, per run,
its per-batch losses and (rank 0) the final weights to ``OUT/<run>.rank<r>.pt``; the test
compares them. ``OUT/checks.rank<r>.pt`` holds what Lightning's own DeepSpeed strategy did.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerotrain.integrations.lightning import ZeroTrainStrategy, convert_zero_checkpoint_to_fp32_state_dict

SAMPLES, BATCH, EPOCHS, ACCUMULATE = 16, 2, 2, 2  # per epoch: 4 batches a rank, 2 optimizer steps


class TinyRegression(pl.LightningModule):
    """Two linear layers; records each batch's loss (as Lightning computed it, before scaling)."""

    def __init__(self, optimizer: str, init_seed: int = 0, in_configure_model: bool = False):
        super().__init__()
        self.init_seed, self.in_configure_model = init_seed, in_configure_model
        self.net = None if in_configure_model else self._build()
        self.optimizer_name = optimizer
        self.losses: list[float] = []
        self.final_weights: dict[str, torch.Tensor] = {}

    def _build(self):
        torch.manual_seed(self.init_seed)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def configure_model(self):
        # Lightning calls this inside strategy.model_sharded_context(): zero.Init at stage 3
        if self.in_configure_model and self.net is None:
            self.net = self._build()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        # Adam with a schedule Lightning steps after each optimizer step
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_end(self):
        engine = self.trainer.strategy.model
        if hasattr(engine, "module_state_dict"):  # zerotrain's engine: gathers stage-3 shards to rank 0
            state = engine.module_state_dict()
        else:
            state = self.state_dict()
        self.final_weights = {k: v.detach().float().cpu().clone() for k, v in state.items()}


def loader():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=generator)
    y = torch.randn(SAMPLES, 3, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def trainer(strategy, epochs=EPOCHS, precision="32-true"):
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=epochs,
        precision=precision,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )


def save(name, model, run_trainer, **extra):
    out = Path(sys.argv[1])
    rank = run_trainer.global_rank
    record = {
        "losses": model.losses,
        "weights": model.final_weights if rank == 0 else None,
        "global_step": run_trainer.global_step,
        **extra,
    }
    torch.save(record, out / f"{name}.rank{rank}.pt")


def fit(
    name,
    strategy,
    optimizer,
    epochs=EPOCHS,
    precision="32-true",
    init_seed=0,
    ckpt_path=None,
    save_to=None,
    in_configure_model=False,
):
    model = TinyRegression(optimizer, init_seed, in_configure_model)
    run = trainer(strategy, epochs, precision)
    run.fit(model, loader(), ckpt_path=ckpt_path)
    if save_to is not None:
        run.save_checkpoint(save_to)
    save(
        name,
        model,
        run,
        strategy=type(run.strategy).__name__,
        engine=type(run.strategy.model).__name__,
        config=getattr(run.strategy, "config", None),
    )
    return run


def lightning_deepspeed_checks():
    """Lightning's own DeepSpeedStrategy with `deepspeed` = zerotrain: it constructs; on CPU its
    own accelerator check is what stops it."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    import zerotrain.hf

    zerotrain.hf.use_zerotrain_as_deepspeed()  # what a user of Lightning's own strategy adds
    checks = {}
    for name in ("deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"):
        checks[name] = type(trainer(name).strategy).__name__
    checks["DeepSpeedStrategy(stage=3)"] = type(trainer(DeepSpeedStrategy(stage=3)).strategy).__name__
    try:
        trainer("deepspeed_stage_2").fit(TinyRegression("sgd"), loader())
        checks["cpu_fit"] = "trained"
    except RuntimeError as error:
        checks["cpu_fit"] = str(error)
    return checks


def main():
    out = Path(sys.argv[1])
    fit("ddp_sgd", "ddp", "sgd")  # launches rank 1; every later fit runs on these two processes
    fit("ddp_adam", "ddp", "adam")
    for stage in (2, 3):
        fit(f"stage{stage}_sgd", f"zerotrain_stage_{stage}", "sgd")
        fit(f"stage{stage}_adam", ZeroTrainStrategy(stage=stage), "adam")
        # One epoch and a checkpoint, then a model initialised differently resumes it for the second.
        checkpoint = str(out / f"stage{stage}.ckpt")
        fit(f"stage{stage}_adam_first_epoch", f"zerotrain_stage_{stage}", "adam", epochs=1, save_to=checkpoint)
        fit(f"stage{stage}_adam_resumed", f"zerotrain_stage_{stage}", "adam", init_seed=1, ckpt_path=checkpoint)
    fit("stage2_adam_bf16", "zerotrain_stage_2", "adam", precision="bf16-mixed")
    # fp16 with a static loss scale (the dynamic one skips steps while it finds its scale)
    fit("stage2_adam_fp16", ZeroTrainStrategy(stage=2, loss_scale=128), "adam", precision="16-mixed")
    fit("stage3_offload_adam", "zerotrain_stage_3_offload", "adam")  # optimizer and parameters in CPU memory
    run = fit("stage3_sgd_configure_model", "zerotrain_stage_3", "sgd", in_configure_model=True)
    # The stage-3 checkpoint as one file (rank 0 writes it), loaded into a differently initialised
    # model by gathering each layer (load_full_weights=True): weights only, not the optimizer.
    full = out / "stage3_full.pt"
    if run.global_rank == 0:
        convert_zero_checkpoint_to_fp32_state_dict(out / "stage3.ckpt", full)
    run.strategy.barrier()
    fit(
        "stage3_adam_full_weights",
        ZeroTrainStrategy(stage=3, load_full_weights=True),
        "adam",
        init_seed=1,
        ckpt_path=str(full),
    )
    torch.save(lightning_deepspeed_checks(), out / f"checks.rank{os.environ['LOCAL_RANK']}.pt")


if __name__ == "__main__":
    main()
