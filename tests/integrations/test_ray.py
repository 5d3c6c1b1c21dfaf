"""zerotrain inside Ray Train's TorchTrainer on a local Ray cluster with 2 CPU workers: ZeRO-2
training on Ray's process group, checkpoints reported to Ray and restored after a worker failure,
rank 0's result, and a failing worker's error surfaced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# A one-machine Ray cluster on loopback only (Ray otherwise talks to itself on the machine's
# network address); read when ray is imported, so set first.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # and the workers' gloo traffic too
# Ray Train's controller looks at its workers every 2 s by default: each start, finish and failure
# here waited up to that long to be noticed. (Read by the controller actor, which Ray Train gives
# the driver's value of this variable.)
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
pytest.importorskip("ray.train", reason="needs Ray Train: pip install 'zerotrain[ray]' (CI installs it)")

import ray  # noqa: E402
from ray.train import FailureConfig, RunConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

from zerotrain.integrations.ray import scaling_config  # noqa: E402

CONFIG = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_scaling_config_from_the_batch_rule():
    scaling = scaling_config(CONFIG, use_gpu=False)
    assert (scaling.num_workers, scaling.use_gpu) == (2, False)
    assert scaling_config({"train_micro_batch_size_per_gpu": 2}, num_workers=3).num_workers == 3
    with pytest.raises(ValueError, match="give num_workers"):
        scaling_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2})
    with pytest.raises(ValueError, match="not a multiple"):
        scaling_config({"train_batch_size": 5, "train_micro_batch_size_per_gpu": 2})


def test_train_checkpoint_restart_and_failure(ray_cluster, tmp_path):
    def train_loop(loop_config):
        # Defined here so Ray ships it by value (workers cannot import this test module).
        import os

        import torch
        import torch.distributed as dist

        import zerotrain
        from zerotrain.integrations import ray as zt_ray
        from zerotrain.models import GPT, GPTConfig

        assert dist.is_initialized()  # Ray's group, which zerotrain.initialize reuses
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
        engine, _, _, _ = zerotrain.initialize(
            model=model, model_parameters=model.parameters(), config=loop_config["ds_config"]
        )
        restored = zt_ray.load_checkpoint(engine)
        resumed_at = engine.global_steps
        checksum = sum(p.double().sum().item() for p in engine.module.parameters())
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
        while engine.global_steps < 4:
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            metrics = {
                "step": engine.global_steps,
                "rank": dist.get_rank(),
                "loss": loss.item(),
                "resumed_at": resumed_at,
                "restored_checksum": checksum if restored else None,
                "checksum": sum(p.double().sum().item() for p in engine.module.parameters()),
            }
            if restored is None and engine.global_steps == 3 and dist.get_rank() == 1:
                os._exit(1)  # dies a step after the step-2 checkpoint; Ray restarts the group from it
            if dist.get_rank() == 0 and restored is None:  # the weights each checkpoint holds
                with open(os.path.join(loop_config["out"], f"checksum{engine.global_steps}"), "w") as f:
                    f.write(repr(metrics["checksum"]))
            zt_ray.report(engine, metrics, client_state={"step": engine.global_steps})

    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"ds_config": CONFIG, "out": str(tmp_path)},
        scaling_config=scaling_config(CONFIG, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp_path), name="restart", failure_config=FailureConfig(max_failures=1)),
    )
    result = trainer.fit()
    assert result.metrics["rank"] == 0 and result.metrics["step"] == 4, result.metrics
    # Restored from a checkpoint of the first attempt (not restarted at step 0), with exactly the
    # weights that checkpoint was saved with. Which one depends on how many reports Ray had
    # registered when the worker died (step 1 or 2).
    resumed_at = result.metrics["resumed_at"]
    assert resumed_at in (1, 2), result.metrics
    saved = float((tmp_path / f"checksum{resumed_at}").read_text())
    assert result.metrics["restored_checksum"] == saved
    assert (Path(result.checkpoint.path) / "global_step4").is_dir()

    def failing_loop(_config):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("bad shard on rank 1")

    failing = TorchTrainer(
        failing_loop,
        scaling_config=scaling_config(CONFIG, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp_path), name="failing", failure_config=FailureConfig(max_failures=0)),
    )
    with pytest.raises(Exception) as err:
        failing.fit()
    assert "ValueError: bad shard on rank 1" in str(err.value)
