"""``zerotrain convert-deepspeed``: checkpoints made by DeepSpeed 0.19.8 on 2 CPU ranks
(tests/checkpoint/fixtures/deepspeed, made by make_deepspeed_fixtures.py) convert, load into
zerotrain engines and continue with DeepSpeed's own next losses. DeepSpeed is not needed.

One process group of 2 ranks runs every continuation: each fixture at its own stage and
precision on 2 ranks, one at another stage, one without its optimizer state (the control that
shows the losses depend on the converted optimizer state), and two on 1 rank (each rank alone
in its own data-parallel group) at other stages."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.checkpoint.fixtures import deepspeed_workload as work
from zerotrain.checkpoint.deepspeed_files import safe_load
from zerotrain.checkpoint.deepspeed_import import convert_deepspeed_checkpoint
from zerotrain.checkpoint.deepspeed_params import assign_groups
from zerotrain.checkpoint.format import CheckpointError, CheckpointReader, resolve_tag
from zerotrain.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zerotrain.testing import run_on_ranks

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
NAMES = list(work.FIXTURES)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (fixture, zerotrain stage, load_optimizer_states) on 2 ranks, beyond each fixture as saved
OTHER_STAGE = ("stage1-bf16", 3, True)
NO_OPTIMIZER = ("stage2-fp32", 2, False)
# (fixture, zerotrain stage) on 1 rank: rank 0's case and rank 1's case
ONE_RANK = [("stage2-fp32", 0), ("stage3-fp32", 1)]
RTOL = 1e-5
# After the first step the 16-bit runs may differ from DeepSpeed's by rounding (the two
# libraries reduce and accumulate 16-bit gradients differently), within one unit in the last
# place of a 16-bit loss; the converted optimizer state itself is checked bit for bit.
ULP = {"fp32": RTOL, "bf16": 2.0**-7, "fp16": 2.0**-10}


def _train(engine, steps: int, rank: int, world: int, group) -> list[float]:
    import torch.distributed as dist

    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for _ in range(steps):
        step, total = engine.global_steps, torch.zeros((), dtype=torch.float64)
        for m in range(gas):
            batch = work.batch_for(step, m, rank, world, micro, gas)
            loss = engine(batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / (world * gas))
    return losses


def _continue(folder: str, name: str, stage: int, load_optimizer: bool = True, group=None) -> dict:
    """Load the converted ``name`` into a fresh engine at ``stage`` and train on."""
    import torch.distributed as dist

    import zerotrain

    _, precision, extra = work.FIXTURES[name]
    world = dist.get_world_size(group)
    cfg = work.config(stage, precision, extra)
    if stage == 3:  # small tensors whole: with every bias partitioned, zerotrain's ZeRO-3
        # backward fetches units in a rank-dependent order (a collective mismatch; reported)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    if world == 1:  # the same global batch of 8 sequences
        cfg["train_micro_batch_size_per_gpu"] = work.MICRO * 2
    model = work.make_model(seed=1)  # other initial weights: everything must come from the file
    engine, *_ = zerotrain.initialize(
        model=model, optimizer=work.make_optimizer(model), config=cfg, data_parallel_group=group
    )
    _, client = engine.load_checkpoint(folder, load_optimizer_states=load_optimizer)
    loaded = {k: v.clone() for k, v in engine.module_state_dict().items()}
    counters = (engine.global_steps, engine.global_samples, engine.micro_steps, engine.loss_scale)
    losses = _train(engine, work.STEPS_AFTER, dist.get_rank(group), world, group)
    out = {
        "losses": losses,
        "client": client,
        "counters": counters,
        "lr": engine.get_lr(),
        "global_steps": engine.global_steps,
        "loaded": loaded,
    }
    engine.destroy()
    return out


def continue_runs(converted: dict) -> dict:
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for name in NAMES:
        out[name] = _continue(converted[name], name, work.FIXTURES[name][0])
    for name, stage, load_optimizer in (OTHER_STAGE, NO_OPTIMIZER):
        out[(name, stage, load_optimizer)] = _continue(converted[name], name, stage, load_optimizer)
    groups = [dist.new_group([0]), dist.new_group([1])]
    rank = dist.get_rank()
    name, stage = ONE_RANK[rank]
    out[("one rank", name, stage)] = _continue(converted[name], name, stage, group=groups[rank])
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return {name: str(convert_deepspeed_checkpoint(FIXTURES / name, root / name).parent) for name in NAMES}


@pytest.fixture(scope="module")
def results(converted):
    ranks = run_on_ranks(continue_runs, 2, args=(converted,), timeout=300)
    return ranks[0] | {k: v for k, v in ranks[1].items() if k[0] == "one rank"}


def _assert_losses(got: list[float], want: list[float], name, later: float = RTOL) -> None:
    """The next step's loss within 1e-5 relative (it depends on the weights alone); the ones
    after it (they depend on the optimizer state too) within ``later``."""
    for step, (g, w) in enumerate(zip(got, want)):
        tolerance = RTOL if step == 0 else later
        assert abs(g - w) <= tolerance * abs(w), f"{name}: step {step} after the checkpoint: {g} vs DeepSpeed's {w}"


def _digest(t: torch.Tensor) -> str:  # as make_deepspeed_fixtures.digest
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("name", NAMES)
def test_converted_state_is_deepspeeds(converted, name):
    """Every trainable parameter's fp32 master and Adam moments in the converted checkpoint
    are bit for bit the ones DeepSpeed's own accessors reported at the save, and so is
    Adam's ``step``."""
    want = EXPECTED["fixtures"][name]["fp32_state_at_save"]
    reader = CheckpointReader(resolve_tag(converted[name])[0])
    try:
        for param, digests in want.items():
            got = {"master": _digest(reader.truth(param))}
            got.update({k: _digest(reader.read(param, f"state/{k}")) for k in ("exp_avg", "exp_avg_sq")})
            assert got == digests, param
        state = torch.load(reader.folder / "state.rank00000.pt", weights_only=True)
        steps = sorted({float(s["step"]) for s in state["scalars"].values()})
        assert steps == EXPECTED["fixtures"][name]["adam_steps_at_save"]
        frozen = reader.meta["frozen"]
        assert frozen == list(work.FROZEN) and reader.meta["param_groups"] == 2
    finally:
        reader.close()


@pytest.mark.parametrize("name", NAMES)
def test_fixture_continues_with_deepspeeds_losses(results, converted, name):
    """Converted, loaded into a fresh engine at the same stage and precision on 2 ranks: the
    next steps' losses are DeepSpeed's; counters, LR, loss scale and client state follow."""
    want = EXPECTED["fixtures"][name]
    got = results[name]
    _assert_losses(got["losses"], want["losses_after"], name, ULP[want["precision"]])
    steps = EXPECTED["steps_before"]
    assert got["counters"][:3] == (steps, steps * 8, steps * work.GAS)
    assert got["global_steps"] == steps + work.STEPS_AFTER
    assert got["lr"] == pytest.approx(want["lr_after"], rel=1e-12)
    assert got["client"] == {"epoch": 1, "note": "fixture"}
    if want["precision"] == "fp16":  # DeepSpeed's dynamic scale at the save: 256 doubled once
        assert got["counters"][3] == 512.0
    # `zerotrain consolidate` of the converted checkpoint: the loaded weights' fp32 masters
    dtype = DTYPES[want["precision"]]
    consolidated = get_fp32_state_dict_from_zero_checkpoint(converted[name])
    assert set(consolidated) <= set(got["loaded"])
    assert set(got["loaded"]) - set(consolidated) <= ({"lm_head.weight"} if want["stage"] == 3 else set())
    for key, value in consolidated.items():
        assert torch.equal(value.to(dtype), got["loaded"][key]), key


def test_other_stage_and_world_size(results):
    """The converted checkpoint loads at another stage (bf16 ZeRO-1 -> ZeRO-3) and on 1 rank
    (ZeRO-2 -> 0, ZeRO-3 -> 1) with DeepSpeed's losses."""
    name, stage, _ = OTHER_STAGE
    _assert_losses(results[OTHER_STAGE]["losses"], EXPECTED["fixtures"][name]["losses_after"], OTHER_STAGE, ULP["bf16"])
    for name, stage in ONE_RANK:
        got = results[("one rank", name, stage)]
        _assert_losses(got["losses"], EXPECTED["fixtures"][name]["losses_after"], (name, stage))
        assert got["counters"][:3] == (3, 24, 6)


def test_losses_depend_on_the_converted_optimizer_state(results):
    """Control: without the optimizer state the first loss (weights only) still matches, the
    next ones do not -- so the comparison above checks the converted Adam moments and step."""
    want = EXPECTED["fixtures"][NO_OPTIMIZER[0]]["losses_after"]
    got = results[NO_OPTIMIZER]["losses"]
    _assert_losses(got[:1], want[:1], NO_OPTIMIZER)
    assert abs(got[1] - want[1]) > 100 * RTOL * abs(want[1])


class _Sneaky:
    """Unpickling this would run ``_mark_unpickled`` (a stand-in for arbitrary code)."""

    def __init__(self, mark: Path):
        self.mark = str(mark)

    def __reduce__(self):
        return (_mark_unpickled, (self.mark,))


def _mark_unpickled(path):
    Path(path).write_text("unpickled")


def _with_extra(tmp_path: Path, name: str, value) -> Path:
    """A copy of ``name`` whose model-states file also holds ``{"args": value}``."""
    copy = tmp_path / name
    shutil.copytree(FIXTURES / name, copy)
    path = copy / "global_step3" / "mp_rank_00_model_states.pt"
    state = safe_load(path)
    state["args"] = value
    torch.save(state, path)
    return copy


def test_disallowed_pickled_type_is_refused(tmp_path):
    mark = tmp_path / "unpickled"
    source = _with_extra(tmp_path, "stage1-fp32", _Sneaky(mark))
    with pytest.raises(CheckpointError, match=r"_mark_unpickled.*refusing to load") as error:
        convert_deepspeed_checkpoint(source, tmp_path / "out")
    assert "mp_rank_00_model_states.pt" in str(error.value)
    assert not mark.exists() and not (tmp_path / "out" / "global_step3").exists()
    assert not (tmp_path / "out" / "latest").exists()
    # an allowed type (Megatron-style args) comes back as a plain dict in the client state
    source = _with_extra(tmp_path / "ns", "stage1-fp32", argparse.Namespace(lr=0.1, name="run"))
    folder = convert_deepspeed_checkpoint(source, tmp_path / "ns-out")
    state = torch.load(folder / "state.rank00000.pt", weights_only=True)
    assert state["client_state"] == {"epoch": 1, "note": "fixture", "args": {"lr": 0.1, "name": "run"}}


def test_stage0_parameter_groups(tmp_path):
    """Stage 0 records the optimizer state by position: the groups are matched by shape, given
    by name (the result is the same), or refused when the shapes are ambiguous or wrong."""
    groups = EXPECTED["fixtures"]["stage0-fp32"]["param_groups"]
    by_shape = convert_deepspeed_checkpoint(FIXTURES / "stage0-fp32", tmp_path / "a")
    by_name = convert_deepspeed_checkpoint(FIXTURES / "stage0-fp32", tmp_path / "b", param_groups=groups)
    assert (by_shape / "model.safetensors").read_bytes() == (by_name / "model.safetensors").read_bytes()
    swapped = [groups[0][:1] + groups[0][2:3] + groups[0][1:2] + groups[0][3:], groups[1]]
    with pytest.raises(CheckpointError, match="blocks.0.attn.proj.weight has shape"):
        convert_deepspeed_checkpoint(FIXTURES / "stage0-fp32", tmp_path / "c", param_groups=swapped)
    with pytest.raises(CheckpointError, match="stage-0 checkpoints only"):
        convert_deepspeed_checkpoint(FIXTURES / "stage1-fp32", tmp_path / "d", param_groups=groups)
    order = [("a", (4,)), ("b", (4,)), ("c", (2, 2)), ("frozen", (3,))]
    assert assign_groups(order, [[(2, 2)], [(4,), (4,)]], "x") == [["c"], ["a", "b"]]
    with pytest.raises(CheckpointError, match="same shape"):  # a in group 0 or group 1?
        assign_groups(order, [[(4,)], [(4,), (2, 2)]], "x")
    with pytest.raises(CheckpointError, match="cannot be matched"):
        assign_groups(order, [[(5,)]], "x")


def test_cli_and_errors(tmp_path, capsys):
    from zerotrain.launcher.cli import main

    out = tmp_path / "out"
    assert main(["convert-deepspeed", str(FIXTURES / "stage3-bf16"), str(out), "--tag", "global_step3"]) == 0
    assert (out / "latest").read_text() == "global_step3"
    assert main(["convert-deepspeed", str(FIXTURES / "stage3-bf16"), str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["convert-deepspeed", str(FIXTURES / "stage3-bf16"), str(tmp_path / "x"), "--tag", "nope"]) == 1
    assert "nope does not exist" in capsys.readouterr().err
    missing = tmp_path / "missing"
    shutil.copytree(FIXTURES / "stage2-bf16", missing)
    (missing / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="ranks \\[1\\]: some ranks' files are missing"):
        convert_deepspeed_checkpoint(missing, tmp_path / "y")
