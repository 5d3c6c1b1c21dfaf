"""DeepSpeed's engine accessors on ZeroTrainEngine: values from the config, set_train_batch_size
taking effect, tput_timer against a scripted clock."""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import adamw_config, global_batches, make_model
from zerotrain.testing import run_on_ranks


def _accessors(save_dir: str):
    import os

    import zerotrain

    out = {}
    cfg = adamw_config(
        2,
        gas=1,
        bf16={"enabled": True},
        zero_optimization={"stage": 2},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        steps_per_print=1000,
    )
    engine, _, _, _ = zerotrain.initialize(model=make_model(), config=cfg)
    out["bf16"] = {
        "fp16_enabled": engine.fp16_enabled(),
        "bfloat16_enabled": engine.bfloat16_enabled(),
        "zero_optimization": engine.zero_optimization(),
        "partition_gradients": engine.zero_optimization_partition_gradients(),
        "partition_weights": engine.zero_optimization_partition_weights(),
        "offload_optimizer": engine.zero_offload_optimizer(),
        "offload_param": engine.zero_offload_param(),
        "data_types": engine.get_data_types(),
        "comm_dtype": engine.communication_data_type,
        "batch_info": engine.get_batch_info(),
        "scheduler": engine.scheduler_name(),
        "optimizer_params": engine.optimizer_params(),
        "reduce_bucket": engine.zero_reduce_bucket_size(),
        "mp_rank": (engine.get_model_parallel_rank(), engine.mp_world_size),
        "dp_rank": engine.get_data_parallel_rank(),
        "offload_knobs": (engine.super_offload(), engine.cpuadam_cores_perc(), engine.managed_gradient_accumulation()),
    }
    engine.save_fp16_model(save_dir)  # every rank calls; rank 0 writes DeepSpeed's default name
    out["saved"] = os.path.exists(os.path.join(save_dir, "pytorch_model.bin"))
    # set_train_batch_size: the accumulation window grows to 2 micro-steps per rank.
    engine.set_train_batch_size(8)
    data = global_batches(1, 2)[0]
    boundaries = []
    for _ in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(data, labels=data).loss)
        engine.step()
    out["after_set"] = (engine.get_batch_info(), boundaries, engine.global_steps, engine.global_samples)
    engine.destroy()

    cfg = adamw_config(2, fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50})
    engine, _, _, _ = zerotrain.initialize(model=make_model(), config=cfg)
    out["fp16"] = {
        "fp16_enabled": engine.fp16_enabled(),
        "zero_optimization": engine.zero_optimization(),
        "dynamic": engine.dynamic_loss_scale(),
        "initial": engine.initial_dynamic_scale(),
        "args": engine.dynamic_loss_scale_args(),
        "data_types": engine.get_data_types(),
    }
    engine.destroy()
    return out


def test_accessors_report_the_config_and_set_train_batch_size_takes_effect(tmp_path):
    outs = run_on_ranks(_accessors, 2, args=(str(tmp_path),))
    assert outs[0]["saved"]
    assert [out["bf16"]["dp_rank"] for out in outs] == [0, 1]
    for out in outs:
        bf16 = out["bf16"]
        assert (bf16["fp16_enabled"], bf16["bfloat16_enabled"], bf16["zero_optimization"]) == (False, True, True)
        assert (bf16["partition_gradients"], bf16["partition_weights"]) == (True, False)
        assert bf16["offload_optimizer"] is None and bf16["offload_param"] is None
        assert bf16["data_types"] == (torch.bfloat16, torch.bfloat16) and bf16["comm_dtype"] == torch.bfloat16
        assert bf16["batch_info"] == (4, 2, 1) and bf16["scheduler"] == "WarmupLR"
        assert bf16["optimizer_params"] == {"lr": 1e-3, "weight_decay": 0.1}
        assert bf16["reduce_bucket"] == int(5e8) and bf16["mp_rank"] == (0, 1)
        assert bf16["offload_knobs"] == (False, 0.9, True)
        info, boundaries, steps, samples = out["after_set"]
        assert info == (8, 2, 2) and boundaries == [False, True, False, True]
        assert (steps, samples) == (2, 16)
        fp16 = out["fp16"]
        assert (fp16["fp16_enabled"], fp16["zero_optimization"], fp16["dynamic"]) == (True, False, True)
        assert fp16["initial"] == 256.0
        assert fp16["args"] == {
            "init_scale": 256.0,
            "scale_window": 50,
            "delayed_shift": 2,
            "consecutive_hysteresis": False,
            "min_scale": 1,
        }
        assert fp16["data_types"] == (torch.float16, torch.float16)


class _ScriptedClock:
    """Stands in for the ``time`` module in the timers: time moves only when the test says."""

    def __init__(self):
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


def _throughput(step_seconds: list[float]):
    import zerotrain
    from zerotrain.engine import timers

    clock = _ScriptedClock()
    timers.time = clock  # the rank's own process: nothing else runs here
    engine, _, _, _ = zerotrain.initialize(model=make_model(), config=adamw_config(2, gas=2))
    data = global_batches(1, 2)[0]
    before = engine.tput_timer.avg_samples_per_sec()
    for seconds in step_seconds:  # steps of 2 micro-batches; then one forward closes the last window
        for _ in range(2):
            engine.backward(engine(data, labels=data).loss)
            engine.step()
        clock.now += seconds  # the step's time, e.g. compute and data loading
    engine(data, labels=data)
    timer = engine.tput_timer
    timed = sum(step_seconds[timer.start_step :])  # the steps after the warm-up ones
    return before, timer.global_step_count, timer.avg_samples_per_sec(), engine.train_batch_size(), timed


def test_tput_timer_measures_samples_per_second_of_optimizer_steps():
    step_seconds = [7.0, 5.0, 0.25, 0.5, 1.0, 0.75]  # the warm-up steps' times must not count
    before, steps, rate, batch, timed = run_on_ranks(_throughput, 1, args=(step_seconds,))[0]
    assert before == float("-inf") and steps == 6
    assert timed == 2.5
    assert rate == pytest.approx(batch / (timed / (steps - 2)), rel=1e-12), rate
