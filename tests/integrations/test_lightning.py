"""Lightning's real Trainer on zerotrain: ``ZeroTrainStrategy`` (stages 2 and 3) against
Lightning's own DDP on the same LightningModule, checkpoint save and resume, bf16-mixed, and
Lightning's own DeepSpeed strategy with ``deepspeed`` = zerotrain (it constructs; on a CPU its own
accelerator check stops it). One launch: tests/integrations/lightning_runs.py, which Lightning
itself starts on 2 CPU processes (gloo) and which runs every fit in turn."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Looked up, not imported: importing Lightning costs ~6 CPU-s, paid at collection by every xdist
# worker while only the one running this file needs it (its tests import it themselves).
if importlib.util.find_spec("lightning") is None:
    pytest.skip("needs Lightning: pip install 'zerotrain[lightning]' (CI installs it)", allow_module_level=True)

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
RANKS = (0, 1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        env.pop(name, None)  # Lightning must start the second process itself, on a free port
    done = subprocess.run(
        [sys.executable, str(HERE / "lightning_runs.py"), str(out)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    def load(name, rank=0):
        return torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)

    load.out = out
    return load


def _assert_same_run(run, reference, rel=1e-5, atol=1e-5):
    assert len(run["losses"]) == len(reference["losses"]) == 8  # 2 epochs x 4 batches a rank
    for got, want in zip(run["losses"], reference["losses"]):
        assert got == pytest.approx(want, rel=rel), (run["losses"], reference["losses"])
    if reference["weights"] is not None:
        assert run["weights"].keys() == reference["weights"].keys()
        for name, want in reference["weights"].items():
            torch.testing.assert_close(run["weights"][name], want, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("stage", [2, 3])
def test_zerotrain_strategy_equals_lightning_ddp(runs, stage, optimizer):
    # accumulate_grad_batches=2: SGD fails if the engine divides Lightning's already divided loss
    # again (DeepSpeed's default: the weights then differ by 5e-2 here); Adam would hide that.
    for rank in RANKS:
        run, reference = runs(f"stage{stage}_{optimizer}", rank), runs(f"ddp_{optimizer}", rank)
        assert (run["strategy"], run["engine"]) == ("ZeroTrainStrategy", "ZeroTrainEngine")
        assert run["global_step"] == reference["global_step"] == 4
        _assert_same_run(run, reference)
    config = runs(f"stage{stage}_{optimizer}")["config"]
    assert config["zero_optimization"]["stage"] == stage
    assert config["gradient_accumulation_steps"] == 2 and "bf16" not in config and "fp16" not in config


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_save_and_resume(runs, stage):
    # One epoch, trainer.save_checkpoint, then a differently initialised model resumes for the
    # second epoch (optimizer state, loops, epoch from the checkpoint): the uninterrupted run.
    assert (runs.out / f"stage{stage}.ckpt" / "checkpoint").is_dir()
    assert (runs.out / f"stage{stage}.ckpt" / "latest").read_text().strip() == "checkpoint"
    for rank in RANKS:
        first, resumed = runs(f"stage{stage}_adam_first_epoch", rank), runs(f"stage{stage}_adam_resumed", rank)
        whole = runs(f"stage{stage}_adam", rank)
        assert (len(first["losses"]), len(resumed["losses"]), resumed["global_step"]) == (4, 4, 4)
        assert first["losses"] + resumed["losses"] == pytest.approx(whole["losses"], rel=1e-6)
        if rank == 0:
            for name, want in whole["weights"].items():
                torch.testing.assert_close(resumed["weights"][name], want, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision(runs, precision):
    from tests.integrations.lightning_runs import TinyRegression

    run, reference = runs(f"stage2_adam_{precision}"), runs("ddp_adam")
    # the section Lightning's precision plugin adds for precision="bf16-mixed" / "16-mixed"
    if precision == "bf16":
        assert run["config"]["bf16"] == {"enabled": True} and "fp16" not in run["config"]
    else:
        assert run["config"]["fp16"]["enabled"] and run["config"]["fp16"]["loss_scale"] == 128
        assert "bf16" not in run["config"]
    _assert_same_run(run, reference, rel=2e-2, atol=float("inf"))
    initial = TinyRegression("adam").state_dict()
    for name, start in initial.items():
        update, reference_update = run["weights"][name] - start, reference["weights"][name] - start
        assert (update - reference_update).norm() <= 0.25 * reference_update.norm(), name


def test_lightning_deepspeed_strategy_is_stopped_only_by_its_cuda_check(runs):
    for rank in RANKS:
        checks = runs("checks", rank)
        for name in ("deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "DeepSpeedStrategy(stage=3)"):
            assert checks[name] == "DeepSpeedStrategy"
        assert checks["cpu_fit"] == (
            "The DeepSpeed strategy is only supported on CUDA GPUs but `CPUAccelerator` is used."
        )


def test_stage3_offload(runs):
    for rank in RANKS:
        run = runs("stage3_offload_adam", rank)
        assert run["config"]["zero_optimization"]["offload_param"]["device"] == "cpu"
        _assert_same_run(run, runs("ddp_adam", rank))


def test_stage3_model_built_in_configure_model(runs):
    # Lightning builds it inside strategy.model_sharded_context(), i.e. zerotrain's zero.Init
    for rank in RANKS:
        _assert_same_run(runs("stage3_sgd_configure_model", rank), runs("ddp_sgd", rank))


def test_stage3_checkpoint_as_one_file_and_load_full_weights(runs):
    from tests.integrations.lightning_runs import TinyRegression

    # convert_zero_checkpoint_to_fp32_state_dict: Lightning's state and the gathered fp32 weights
    full = torch.load(runs.out / "stage3_full.pt", weights_only=False)
    assert (full["epoch"], full["global_step"]) == (1, 2)  # saved after epoch 0 ended: 2 optimizer steps
    assert {"loops", "callbacks", "lr_schedulers", "state_dict"} <= full.keys()
    saved = runs("stage3_adam_first_epoch")["weights"]
    model = TinyRegression.load_from_checkpoint(runs.out / "stage3_full.pt", optimizer="adam", init_seed=1)
    for name, want in saved.items():
        assert torch.equal(full["state_dict"][name], want), name
        assert torch.equal(model.state_dict()[name], want), name
    # ZeroTrainStrategy(stage=3, load_full_weights=True) fits from that file a model initialised
    # otherwise: the weights are the checkpoint's (both batches before the first step of the
    # second epoch give the uninterrupted run's losses on each rank); Adam's state starts afresh,
    # as Lightning's DeepSpeed strategy does with one file, so later losses differ.
    for rank in RANKS:
        resumed, whole = runs("stage3_adam_full_weights", rank), runs("stage3_adam", rank)
        assert (len(resumed["losses"]), resumed["global_step"]) == (4, 4)
        assert resumed["losses"][:2] == pytest.approx(whole["losses"][4:6], rel=1e-6)
        assert resumed["losses"][2] != pytest.approx(whole["losses"][6], rel=1e-4)
