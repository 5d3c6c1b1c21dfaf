"""Every DeepSpeed name zerotrain provides (from /work/shared/reference/deepspeed-compat.md and
issue 13's scripts) imports from its zerotrain path and does its job here.

``PROVIDED`` is the surface; each test below exercises the names it registers with
``@exercises``, and ``test_every_provided_name_is_exercised`` keeps the two in step, so the
surface cannot shrink silently nor grow an untested name.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import pkgutil
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.workloads import adamw_config, global_batches, make_model
from zerotrain.testing import run_on_ranks

# deepspeed name -> zerotrain name ("import deepspeed" becomes "import zerotrain as deepspeed").
PROVIDED = {
    f"deepspeed.{name}": f"zerotrain.{name}"
    for name in """
initialize add_config_arguments init_distributed DeepSpeedEngine get_accelerator logger log_dist
PipelineModule accelerator.get_accelerator ops.adam.FusedAdam ops.adam.DeepSpeedCPUAdam
moe.utils.split_params_into_different_moe_groups_for_optimizer moe.utils.is_moe_param
pipe.PipelineModule pipe.LayerSpec pipe.TiedLayerSpec utils.RepeatingLoader utils.logger utils.log_dist
utils.logging.logger utils.logging.log_dist
runtime.dataloader.RepeatingLoader runtime.utils.set_random_seed runtime.utils.memory_status
runtime.utils.see_memory_usage runtime.zero.partition_parameters.ZeroParamStatus
compression.helper.recursive_getattr compression.helper.recursive_setattr zero.Init zero.GatheredParameters
comm.log_summary runtime.lr_schedules.WarmupLR runtime.lr_schedules.WarmupDecayLR
runtime.lr_schedules.WarmupCosineLR runtime.lr_schedules.OneCycle runtime.lr_schedules.LRRangeTest
runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live
runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live
utils.set_z3_leaf_modules utils.unset_z3_leaf_modules utils.get_z3_leaf_modules utils.z3_leaf_module
runtime.pipe.ProcessTopology runtime.pipe.topology.ProcessTopology runtime.pipe.topology.PipeDataParallelTopology
runtime.pipe.topology.PipeModelDataParallelTopology runtime.pipe.topology.PipelineParallelGrid
runtime.pipe.module.PipelineModule runtime.pipe.module.LayerSpec runtime.pipe.module.TiedLayerSpec
runtime.pipe.module.PipelineError
utils.groups._get_data_parallel_group utils.groups._get_data_parallel_world_size utils.groups._get_data_parallel_rank
utils.groups._create_expert_and_data_parallel utils.groups._get_expert_parallel_group
utils.groups._get_expert_data_parallel_group utils.groups._get_max_expert_size_name
runtime.progressive_layer_drop.ProgressiveLayerDrop
profiling.flops_profiler.FlopsProfiler profiling.flops_profiler.get_model_profile
profiling.flops_profiler.profiler.FlopsProfiler profiling.flops_profiler.profiler.get_model_profile
runtime.engine.DeepSpeedEngine runtime.zero.partition_parameters.get_accelerator
""".split()
}

EXERCISED: set[str] = set()


def exercises(*names: str):
    EXERCISED.update(f"deepspeed.{n}" for n in names)
    return lambda fn: fn


def resolve(dotted: str):
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_every_provided_name_imports():
    for ds_name, zt_name in PROVIDED.items():
        assert resolve(zt_name) is not None, ds_name


def test_every_provided_name_is_exercised():
    assert sorted(set(PROVIDED) - EXERCISED) == []
    assert sorted(EXERCISED - set(PROVIDED)) == []


# -- attribute paths after the top-level import (issue 29 item 15) -------------------------
# ``import deepspeed`` loads most of its tree, so scripts write ``deepspeed.runtime.utils.set_random_seed``
# without importing ``deepspeed.runtime.utils``. The file lists every module path DeepSpeed 0.19.8
# makes reachable that way; each zerotrain module under the same name (found by pkgutil) must be
# reachable from a bare ``import zerotrain`` too, and so must each PROVIDED name that lives there.
REACHABLE_IN_DEEPSPEED = [
    line.strip()
    for line in (Path(__file__).parent / "deepspeed_reachable_modules.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]

_RESOLVE_IN_FRESH_PROCESS = """
import json, sys
import zerotrain
torch_after_import = "torch" in sys.modules
missing = {}
for path in json.loads(sys.argv[1]):
    obj = zerotrain
    for part in path.split(".")[1:]:
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            missing[path] = str(exc)
            break
print(json.dumps({"torch_after_import": torch_after_import, "missing": missing}))
"""


def _zerotrain_modules():
    import zerotrain
    from zerotrain._lazy import public_name

    # The DeepSpeed-named files sit in deepspeed_paths/; each is imported under its public name.
    return ["zerotrain"] + [public_name(m.name) for m in pkgutil.walk_packages(zerotrain.__path__, "zerotrain.")]


def _deepspeed_name(zerotrain_name):
    return "deepspeed" + zerotrain_name[len("zerotrain") :]


def test_deepspeed_reachable_paths_are_attributes_after_import_zerotrain():
    reachable = set(REACHABLE_IN_DEEPSPEED)
    modules = [m for m in _zerotrain_modules() if _deepspeed_name(m) in reachable]
    # A name is reachable in DeepSpeed when the module holding it is (compression.helper's are not).
    names = [zt for ds, zt in PROVIDED.items() if ds.rpartition(".")[0] in reachable]
    # The scripts' paths (issue 29 item 15), so the discovery above cannot pass by finding nothing.
    for expected in (
        "zerotrain.runtime.utils",
        "zerotrain.runtime.zero",
        "zerotrain.ops.adam",
        "zerotrain.moe.utils",
        "zerotrain.runtime.zero.partition_parameters",
        "zerotrain.utils.timer",
    ):
        assert expected in modules
    names += [
        "zerotrain.runtime.utils.set_random_seed",
        "zerotrain.ops.adam.FusedAdam",
        "zerotrain.runtime.zero.Init",
        "zerotrain.runtime.zero.GatheredParameters",
        "zerotrain.runtime.zero.ZeroParamStatus",
        "zerotrain.utils.recursive_getattr",
    ]
    paths = modules + names
    result = subprocess.run(
        [sys.executable, "-c", _RESOLVE_IN_FRESH_PROCESS, json.dumps(paths)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["missing"] == {}
    # The submodules load on first access: the top-level import itself stays free of torch.
    assert out["torch_after_import"] is False
    # And each path is the object the dotted import gives.
    for path in modules:
        if path != "zerotrain":
            assert resolve(path) is importlib.import_module(path)
    assert resolve("zerotrain.runtime.zero.Init") is resolve("zerotrain.zero.Init")


def test_modules_deepspeed_does_not_load_are_not_in_the_reference():
    # zerotrain ships these DeepSpeed names, but `import deepspeed` does not load them (a script
    # imports them itself); the walk above leaves them alone.
    for name in ("deepspeed.compression", "deepspeed.compression.helper", "deepspeed.launcher.launch"):
        assert name not in REACHABLE_IN_DEEPSPEED
    assert len(REACHABLE_IN_DEEPSPEED) > 400 and "deepspeed.runtime.utils" in REACHABLE_IN_DEEPSPEED


def test_pipeline_example_import_level_lines():
    """DeepSpeedExamples training/pipeline_parallelism/train.py, with ``import zerotrain as deepspeed``:
    everything it touches at import level and before initialize."""
    script = """
import argparse, random, json
import torch
import zerotrain as deepspeed
from zerotrain.pipe import PipelineModule
from zerotrain.utils import RepeatingLoader
parser = argparse.ArgumentParser(description='CIFAR')
parser.add_argument('--seed', type=int, default=1138)
args = deepspeed.add_config_arguments(parser).parse_args(['--deepspeed_config', 'ds.json'])
torch.manual_seed(args.seed)
deepspeed.runtime.utils.set_random_seed(args.seed)
first = (random.random(), float(torch.rand(())))
deepspeed.runtime.utils.set_random_seed(args.seed)
print(json.dumps({"same": first == (random.random(), float(torch.rand(()))), "config": args.deepspeed_config,
                  "pipe": deepspeed.pipe.PipelineModule is PipelineModule,
                  "loader": list(zip(range(5), RepeatingLoader([1, 2])))}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"same": True, "config": "ds.json", "pipe": True, "loader": [[0, 1], [1, 2], [2, 1], [3, 2], [4, 1]]}


# -- one 2-rank run: the training surface ------------------------------------------------
def _train_surface():
    import io
    from contextlib import redirect_stdout

    import torch.distributed as dist

    import zerotrain as deepspeed
    from zerotrain.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from zerotrain.ops.adam import FusedAdam
    from zerotrain.utils import RepeatingLoader

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # FusedAdam (no bias correction) as the client optimizer, its groups from the MoE helper.
    model = make_model()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "weight_decay": 0.01}
    )
    out["groups_unchanged"] = len(groups) == 1 and groups[0]["name"] == "dense"
    optimizer = FusedAdam(groups, lr=1e-3, bias_correction=False)
    data = torch.stack([global_batches(1, 8, seed=s)[0] for s in range(3)])  # 3 steps x 8 rows
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
        "comms_logger": {"enabled": True},
    }
    engine, _, loader, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, training_data=list(data.reshape(-1, data.shape[-1]))
    )
    out["engine"] = isinstance(engine, deepspeed.DeepSpeedEngine)
    for step in range(3):
        for micro in range(2):
            lo = (micro * world + rank) * 2
            batch = data[step, lo : lo + 2]
            engine.backward(engine(batch, labels=batch).loss)
            engine.step()
    out["trained"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["accessors"] = (
        engine.fp16_enabled(),
        engine.bfloat16_enabled(),
        engine.zero_optimization_stage(),
        engine.train_batch_size(),
        engine.global_steps,
        engine.get_lr(),
    )
    # RepeatingLoader over the engine's dataloader: more batches than one pass holds.
    repeating = RepeatingLoader(loader)
    out["repeated"] = [next(repeating).shape for _ in range(len(loader) * 2 + 1)]
    text = io.StringIO()
    with redirect_stdout(text):
        deepspeed.comm.log_summary()
        status = deepspeed.runtime.utils.memory_status("after training")
    out["log_summary"] = text.getvalue()
    out["memory_status"] = sorted(status)
    engine.destroy()
    # zero.Init partitions at construction; GatheredParameters shows the whole weight.
    with deepspeed.zero.Init():
        layer = torch.nn.Linear(8, 6)
    out["partitioned"] = deepspeed.zero.is_partitioned(layer.weight), layer.weight.data.numel()
    with deepspeed.zero.GatheredParameters(layer.weight):
        out["gathered_shape"] = tuple(layer.weight.shape), layer.weight.data.numel()
    return out


def _reference_training():
    from zerotrain.ops.adam import FusedAdam

    model = make_model()
    optimizer = FusedAdam(model.parameters(), lr=1e-3, bias_correction=False)
    data = torch.stack([global_batches(1, 8, seed=s)[0] for s in range(3)])
    for step in range(3):
        optimizer.zero_grad()
        for micro in range(2):  # 2 micro-batches of 4 rows (2 per rank): mean of the micro losses
            batch = data[step, micro * 4 : micro * 4 + 4]
            (model(batch, labels=batch).loss / 2).backward()
        optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@exercises(
    "initialize",
    "init_distributed",
    "DeepSpeedEngine",
    "ops.adam.FusedAdam",
    "moe.utils.split_params_into_different_moe_groups_for_optimizer",
    "utils.RepeatingLoader",
    "comm.log_summary",
    "runtime.utils.memory_status",
    "zero.Init",
    "zero.GatheredParameters",
)
def test_training_surface_on_two_ranks():
    outs = run_on_ranks(_train_surface, 2)
    reference = _reference_training()
    for out in outs:
        assert out["groups_unchanged"] and out["engine"]
        # Engine + FusedAdam(bias_correction=False) at stage 2 == plain single-process training.
        for name, value in reference.items():
            torch.testing.assert_close(out["trained"][name], value, rtol=1e-4, atol=1e-5)
        assert out["accessors"] == (False, False, 2, 8, 3, [1e-3])
        assert out["repeated"] == [torch.Size([2, 16])] * len(out["repeated"])
        assert {"device", "engine", "line"} <= set(out["memory_status"])  # engine: its bytes by category
        assert out["partitioned"][0] and out["partitioned"][1] < 48
        assert out["gathered_shape"] == ((6, 8), 48)
    assert "Comm. Op" in outs[0]["log_summary"]


# -- single-process names ------------------------------------------------------------------
@exercises("get_accelerator", "accelerator.get_accelerator")
def test_accelerator_names():
    import zerotrain
    from zerotrain.accelerator import get_accelerator

    accelerator = zerotrain.get_accelerator()
    assert accelerator is get_accelerator()
    device = torch.device(accelerator.device_name(), 0)
    assert device.type == accelerator.name and accelerator.is_available()
    accelerator.manual_seed_all(7)
    a = torch.rand(3, device=accelerator.device())
    accelerator.manual_seed_all(7)
    assert torch.equal(a, torch.rand(3, device=accelerator.device()))


@exercises("add_config_arguments")
def test_add_config_arguments():
    import zerotrain

    parser = zerotrain.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json"


@exercises("ops.adam.DeepSpeedCPUAdam")
def test_cpu_adam_steps():
    from zerotrain.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.ones(3))
    opt = DeepSpeedCPUAdam([p], lr=0.1, adamw_mode=True, weight_decay=0.0)
    p.grad = torch.ones(3)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.9))  # first Adam step moves by lr


@exercises("moe.utils.is_moe_param")
def test_expert_parameters_get_their_own_groups():
    from zerotrain.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    dense, expert = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
    expert.allreduce, expert.group_name = False, "ep_size_2"
    assert not is_moe_param(dense) and is_moe_param(expert)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [dense, expert], "name": "all", "lr": 0.1}]
    )
    assert [g["params"] for g in groups] == [[dense], [expert]]
    assert groups[1]["moe"] and groups[1]["name"] == "ep_size_2" and groups[1]["lr"] == 0.1


@exercises(
    "PipelineModule",
    "pipe.PipelineModule",
    "pipe.LayerSpec",
    "pipe.TiedLayerSpec",
    "runtime.pipe.module.PipelineModule",
    "runtime.pipe.module.LayerSpec",
    "runtime.pipe.module.TiedLayerSpec",
    "runtime.pipe.module.PipelineError",
)
def test_pipe_specs_build_and_pipeline_module_builds_one_stage():
    import zerotrain
    import zerotrain.runtime.pipe.module as ds_module
    from zerotrain.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    assert (ds_module.PipelineModule, ds_module.LayerSpec, ds_module.TiedLayerSpec) == (
        PipelineModule,
        LayerSpec,
        TiedLayerSpec,
    )
    assert issubclass(ds_module.PipelineError, Exception) and ds_module.PipelineError is zerotrain.pipe.PipelineError

    layer = LayerSpec(torch.nn.Linear, 4, 8, bias=False).build()
    assert isinstance(layer, torch.nn.Linear) and layer.bias is None and layer.out_features == 8
    tied = TiedLayerSpec("embed", torch.nn.Embedding, 10, 4, tied_weight_attr="weight")
    assert tied.key == "embed" and tied.tied_weight_attr == ["weight"]
    assert tied.build().weight.shape == (10, 4)
    with pytest.raises(RuntimeError, match="torch.nn.Module"):
        LayerSpec(len)
    assert zerotrain.PipelineModule is PipelineModule
    module = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4), torch.nn.ReLU()], num_stages=1)
    assert module.parts == [0, 2] and list(module.state_dict()) == ["0.weight", "0.bias"]
    with pytest.raises(RuntimeError, match="num_stages=2 does not divide the world size 1"):
        PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4)], num_stages=2)


@exercises("logger", "log_dist", "utils.logger", "utils.log_dist", "utils.logging.logger", "utils.logging.log_dist")
def test_logger_and_log_dist(caplog):
    import zerotrain
    from zerotrain.utils import log_dist, logger

    assert zerotrain.logger is logger and zerotrain.log_dist is log_dist
    # Lightning's DeepSpeed strategy sets the level through deepspeed.utils.logging.logger
    assert zerotrain.utils.logging.logger is logger and zerotrain.utils.logging.log_dist is log_dist
    assert isinstance(logger, logging.Logger)
    logger.propagate = True  # let caplog see it
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            log_dist("hello from no process group", ranks=[0])
    finally:
        logger.propagate = False
    assert "[Rank -1] hello from no process group" in caplog.text


@exercises("runtime.dataloader.RepeatingLoader")
def test_repeating_loader_restarts():
    from zerotrain.runtime.dataloader import RepeatingLoader
    from zerotrain.utils import RepeatingLoader as FromUtils

    assert FromUtils is RepeatingLoader
    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))


@exercises("runtime.utils.set_random_seed")
def test_set_random_seed_seeds_python_numpy_and_torch():
    import numpy

    from zerotrain.runtime.utils import set_random_seed

    def draw():
        return random.random(), float(numpy.random.rand()), float(torch.rand(()))

    set_random_seed(2**70 + 5)  # larger than numpy and torch accept: reduced as DeepSpeed does
    first = draw()
    set_random_seed(2**70 + 5)
    assert draw() == first
    set_random_seed(6)
    assert draw() != first


@exercises("runtime.utils.see_memory_usage")
def test_see_memory_usage_logs_when_forced(caplog):
    from zerotrain.log import logger
    from zerotrain.runtime.utils import see_memory_usage

    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            see_memory_usage("not forced")
            see_memory_usage("forced", force=True)
    finally:
        logger.propagate = False
    assert "not forced" not in caplog.text and "forced" in caplog.text and "CPU Virtual Memory" in caplog.text


@exercises("runtime.zero.partition_parameters.ZeroParamStatus")
def test_zero_param_status_has_deepspeeds_values():
    from zerotrain.runtime.zero.partition_parameters import ZeroParamStatus

    assert {s.name: s.value for s in ZeroParamStatus} == {"AVAILABLE": 1, "NOT_AVAILABLE": 2, "INFLIGHT": 3}


@exercises("runtime.engine.DeepSpeedEngine", "runtime.zero.partition_parameters.get_accelerator")
def test_engine_class_and_accelerator_under_deepspeeds_module_paths():
    # TRL types the engine as deepspeed.runtime.engine.DeepSpeedEngine; transformers reads
    # get_accelerator from partition_parameters. Both are zerotrain's own objects, by attribute too.
    import zerotrain
    from zerotrain.accelerator import get_accelerator
    from zerotrain.runtime.engine import DeepSpeedEngine
    from zerotrain.runtime.zero.partition_parameters import get_accelerator as from_partition_parameters

    assert DeepSpeedEngine is zerotrain.ZeroTrainEngine is zerotrain.runtime.engine.DeepSpeedEngine
    assert from_partition_parameters is get_accelerator
    assert from_partition_parameters() is zerotrain.get_accelerator()


@exercises("runtime.progressive_layer_drop.ProgressiveLayerDrop")
def test_progressive_layer_drop_after_import_zerotrain():
    # Removed from DeepSpeed in 2026; zerotrain keeps it (docs/pld.md), reachable as before.
    import zerotrain

    pld = zerotrain.runtime.progressive_layer_drop.ProgressiveLayerDrop(theta=0.5, gamma=0.001)
    pld.update_state(1000)
    assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 0.5 * math.exp(-1.0) + 0.5}


@exercises(
    "profiling.flops_profiler.FlopsProfiler",
    "profiling.flops_profiler.get_model_profile",
    "profiling.flops_profiler.profiler.FlopsProfiler",
    "profiling.flops_profiler.profiler.get_model_profile",
)
def test_flops_profiler_after_import_zerotrain():
    # DeepSpeed's usage, counted against the layer's two matmuls (tests/monitor/test_flops_profiler.py
    # checks a GPT-2 against a hand count)
    import zerotrain

    profiling = zerotrain.profiling.flops_profiler
    assert profiling.profiler.FlopsProfiler is profiling.FlopsProfiler
    assert profiling.profiler.get_model_profile is profiling.get_model_profile
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    flops, macs, params = profiling.get_model_profile(model, input_shape=(5, 8), print_profile=False, as_string=False)
    assert (flops, macs, params) == (2 * 5 * (8 * 16 + 16 * 4), 5 * (8 * 16 + 16 * 4), 8 * 16 + 16 + 16 * 4 + 4)
    prof = profiling.FlopsProfiler(model)
    prof.start_profile()
    model(torch.ones(5, 8))
    assert prof.get_total_flops() == flops and prof.get_total_params() == params
    prof.end_profile()


@exercises("compression.helper.recursive_getattr", "compression.helper.recursive_setattr")
def test_recursive_getattr_and_setattr():
    from zerotrain.compression.helper import recursive_getattr, recursive_setattr

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    replacement = torch.nn.Identity()
    recursive_setattr(model, "0.0", replacement)
    assert model[0][0] is replacement


@exercises(
    "runtime.lr_schedules.WarmupLR",
    "runtime.lr_schedules.WarmupDecayLR",
    "runtime.lr_schedules.WarmupCosineLR",
    "runtime.lr_schedules.OneCycle",
    "runtime.lr_schedules.LRRangeTest",
)
def test_lr_schedules_module_path():
    from zerotrain.runtime import lr_schedules

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    schedule = lr_schedules.WarmupLR(
        opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear"
    )
    for _ in range(5):
        opt.step()
        schedule.step()
    assert 0.0 < opt.param_groups[0]["lr"] < 0.1
    for name in ("WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"):
        assert getattr(lr_schedules, name) is getattr(importlib.import_module("zerotrain.optim"), name)


@exercises(
    "runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live",
    "runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live",
)
def test_memory_estimators_print_deepspeeds_table(capsys):
    from zerotrain.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    from zerotrain.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live

    model = make_model()
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    printed = capsys.readouterr().out
    assert printed.count("Estimated memory needed for params, optim states and gradients") == 2


@exercises(
    "utils.set_z3_leaf_modules", "utils.unset_z3_leaf_modules", "utils.get_z3_leaf_modules", "utils.z3_leaf_module"
)
def test_leaf_module_flags():
    """DeepSpeed's MoE recipe: ``deepspeed.utils.set_z3_leaf_modules(model, [MoEBlock])`` before
    initialize (tests/zero/test_leaf_modules.py trains with the flags)."""
    from zerotrain.models.gpt import Block
    from zerotrain.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

    model = make_model()
    assert set_z3_leaf_modules(model, [Block]) == list(model.blocks)
    assert get_z3_leaf_modules(model) == list(model.blocks) and z3_leaf_module(model.blocks[0])
    unset_z3_leaf_modules(model, ["Block"])
    assert not any(z3_leaf_module(m) for m in model.modules())


def _topology_names_as_scripts_use_them():
    import torch.distributed as dist

    import zerotrain
    from zerotrain.runtime.pipe import ProcessTopology
    from zerotrain.runtime.pipe.topology import (
        PipeDataParallelTopology,
        PipelineParallelGrid,
        PipeModelDataParallelTopology,
    )
    from zerotrain.utils import groups

    zerotrain.init_distributed()
    layouts = (
        ProcessTopology(["pipe", "data"], [2, 2]).get_axis_comm_lists("data"),
        PipeDataParallelTopology(2, 2).get_axis_comm_lists("pipe"),
        PipeModelDataParallelTopology(1, 2, 2).get_axis_comm_lists("model"),
    )
    grid = PipelineParallelGrid(topology=PipeDataParallelTopology(1, 4))
    engine, _, _, _ = zerotrain.initialize(model=make_model(), config=adamw_config(2), mpu=grid)
    groups._create_expert_and_data_parallel(2)
    t = torch.ones(1)
    dist.all_reduce(t, group=groups._get_expert_parallel_group("ep_size_2"))
    edp = torch.ones(1)
    dist.all_reduce(edp, group=groups._get_expert_data_parallel_group("ep_size_2"))
    dp = torch.ones(1)
    dist.all_reduce(dp, group=groups._get_data_parallel_group())
    return (
        layouts,
        engine.dp_world_size,
        groups._get_data_parallel_world_size(),
        groups._get_data_parallel_rank(),
        t.item(),
        edp.item(),
        dp.item(),
        groups._get_max_expert_size_name(),
    )


@exercises(
    "runtime.pipe.ProcessTopology",
    "runtime.pipe.topology.ProcessTopology",
    "runtime.pipe.topology.PipeDataParallelTopology",
    "runtime.pipe.topology.PipeModelDataParallelTopology",
    "runtime.pipe.topology.PipelineParallelGrid",
    "utils.groups._get_data_parallel_group",
    "utils.groups._get_data_parallel_world_size",
    "utils.groups._get_data_parallel_rank",
    "utils.groups._create_expert_and_data_parallel",
    "utils.groups._get_expert_parallel_group",
    "utils.groups._get_expert_data_parallel_group",
    "utils.groups._get_max_expert_size_name",
)
def test_topology_and_groups_names_drive_an_engine():
    for rank, out in enumerate(run_on_ranks(_topology_names_as_scripts_use_them, world_size=4, timeout=300)):
        assert out[0] == ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1], [2, 3]])
        # the grid's data group (all 4) is the engine's, and the global getters answer from it
        assert out[1:] == (4, 4, rank, 2.0, 2.0, 4.0, "ep_size_2")
