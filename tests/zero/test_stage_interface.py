"""The stage object's declared interface (``zerotrain.zero.interface.StageInterface``).

``build_zero_stage`` returns one of two types: ``ReplicatedGradients`` (fp32 stage 0, engines
without an optimizer below stage 3) and ``ZeroStage`` (16-bit stage 0, stages 1-3).
Both implement the interface; the engine, checkpoints, monitors and the runtime helpers call
its members only, never probing the stage object with ``getattr``/``hasattr`` or reading other
attributes of it. Checked here: both classes subclass it and implement every abstract member
with the declared signature, a class missing one cannot be built, real engines at every stage
hold a conforming object, and a static check over ``src/`` finds no probe and no other member.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from zerotrain.testing import run_on_ranks
from zerotrain.zero.interface import GatherStatistics, ShardedState, StageInterface, StageStatistics
from zerotrain.zero.partition import shard_alignment
from zerotrain.zero.stage0 import ReplicatedGradients
from zerotrain.zero.zero_stage import ZeroStage

SRC = Path(__file__).resolve().parents[2] / "src" / "zerotrain"
# Every module outside zero/ (the stage's own package), the engine's checkpoint, monitor and
# runtime helpers among them.
OWN_PACKAGE = "zero"
# How code outside zero/ reaches the stage object: the engine's private attribute (engine/
# only) and its documented accessor.
STAGE_ATTRIBUTES = ("_zero", "zero_stage_object")


def interface_members() -> set[str]:
    return {name for name in vars(StageInterface) if not name.startswith("_")}


def stage_uses(tree: ast.AST):
    """``(line, kind, detail)`` for every use of the stage object in ``tree`` the rule forbids:
    a ``getattr``/``hasattr`` call on it, or an attribute of it that is no interface member."""
    members = interface_members()
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and node.args
        ):
            target = node.args[0]
            if isinstance(target, ast.Attribute) and target.attr in STAGE_ATTRIBUTES:
                found.append((node.lineno, node.func.id, ast.unparse(node)))
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in STAGE_ATTRIBUTES
            and node.attr not in members
        ):
            found.append((node.lineno, "member", ast.unparse(node)))
    return found


def violations(root: Path = SRC) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == OWN_PACKAGE:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, kind, detail in stage_uses(tree):
            out.append(f"{rel.as_posix()}:{line}: {kind}: {detail}")
        if rel.parts[0] != "engine":  # the engine's private attribute stays inside the engine
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == "_zero":
                    out.append(f"{rel.as_posix()}:{node.lineno}: private: {ast.unparse(node)}")
    return out


def test_no_probe_and_no_other_member_of_the_stage_object_in_src():
    found = violations()
    assert not found, "the stage object is used outside its interface:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "code, kind",
    [
        ("def f(engine):\n    return getattr(engine._zero, 'coordinator', None)\n", "getattr"),
        ("def f(self):\n    return hasattr(self._zero, 'units')\n", "hasattr"),
        ("def f(engine):\n    return engine.zero_stage_object.units\n", "member"),
        ("def f(engine):\n    return getattr(engine.zero_stage_object, 'statistics', dict)()\n", "getattr"),
    ],
)
def test_the_static_check_finds_probes(code, kind):
    assert [k for _, k, _ in stage_uses(ast.parse(code))] == [kind]
    ok = "def f(engine):\n    return engine.zero_stage_object.sharded_state().units\n"
    assert stage_uses(ast.parse(ok)) == []


def test_the_static_check_finds_private_access_outside_the_engine(tmp_path):
    for folder in ("checkpoint", "engine", "zero"):
        (tmp_path / folder).mkdir()
    (tmp_path / "checkpoint" / "bad.py").write_text("def f(engine):\n    return engine._zero.stage\n")
    (tmp_path / "engine" / "fine.py").write_text("def f(self):\n    return self._zero.stage\n")
    (tmp_path / "zero" / "own.py").write_text(  # the stage's own package is not checked
        "def f(self):\n    return getattr(self._zero, 'units', None)\n"
    )
    assert violations(tmp_path) == ["checkpoint/bad.py:2: private: engine._zero"]


def test_both_implementations_implement_every_abstract_member():
    abstract = StageInterface.__abstractmethods__
    assert {
        "stage",
        "begin_backward",
        "end_backward",
        "abort_backward",
        "grad_norm",
        "step",
        "zero_grad",
        "load_module_state",
        "parameter_coordinator",
        "sharded_state",
        "statistics",
        "close",
        "set_gradient_divide_factor",
        "state_tensors",
        "empty_partition_cache",
        "accumulated_grad",
    } == set(abstract)
    assert interface_members() == set(abstract)
    for cls in (ReplicatedGradients, ZeroStage):
        assert issubclass(cls, StageInterface)
        assert not cls.__abstractmethods__, (cls, cls.__abstractmethods__)
        for name in abstract:
            declared = inspect.getattr_static(StageInterface, name)
            implemented = inspect.getattr_static(cls, name)
            if isinstance(declared, property):
                assert isinstance(implemented, (property, int)), (cls, name)
                continue
            assert list(inspect.signature(implemented).parameters) == list(inspect.signature(declared).parameters), (
                cls,
                name,
            )
    with pytest.raises(TypeError, match="abstract"):
        StageInterface()

    class Incomplete(ReplicatedGradients):  # one member left abstract again
        statistics = StageInterface.statistics

    with pytest.raises(TypeError, match="statistics"):
        Incomplete([], 100)


CASES = {  # name: (config additions, expected type, stage)
    "fp32 stage 0": ({"zero_optimization": {"stage": 0}}, "ReplicatedGradients", 0),
    "bf16 stage 0": ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}, "ZeroStage", 0),
    "stage 1": ({"zero_optimization": {"stage": 1}}, "ZeroStage", 1),
    "bf16 stage 2": ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "ZeroStage", 2),
    "stage 3": ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}, "ZeroStage", 3),
}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _padded(numel: int, dtype: torch.dtype, world: int) -> int:
    """A flat unit's elements: ``numel`` padded so each of ``world`` shards is aligned."""
    multiple = shard_alignment(dtype) * world
    return -(-numel // multiple) * multiple


# Bytes each case's statistics report, from the model's parameter counts (6*8+8 and 8*3+3; one
# unit below stage 3, one per Linear at stage 3; 2 ranks; SGD without momentum keeps no state).
MODULE_NUMELS = (6 * 8 + 8, 8 * 3 + 3)
NUMEL = sum(MODULE_NUMELS)
_BF16, _F32 = torch.bfloat16, torch.float32
EXPECTED_MEMORY = {
    "fp32 stage 0": {"parameters": NUMEL * 4, "gradients": NUMEL * 4, "optimizer_state": 0},
    "bf16 stage 0": {
        "parameters": _padded(NUMEL, _BF16, 1) * 2,
        "gradients": _padded(NUMEL, _BF16, 1) * 2,
        "master_parameters": _padded(NUMEL, _BF16, 1) * 4,
        "optimizer_state": 0,
    },
    "stage 1": {
        "parameters": _padded(NUMEL, _F32, 2) * 4,
        "gradients": _padded(NUMEL, _F32, 2) * 4,
        "master_parameters": 0,
        "optimizer_state": 0,
    },
    # the whole 16-bit unit; this rank's fp32 master and 16-bit gradient shard
    "bf16 stage 2": {
        "parameters": _padded(NUMEL, _BF16, 2) * 2,
        "gradients": _padded(NUMEL, _BF16, 2) // 2 * 2,
        "master_parameters": _padded(NUMEL, _BF16, 2) // 2 * 4,
        "optimizer_state": 0,
    },
    # this rank's shards of both units, and their gradient shards
    "stage 3": {
        "parameters": sum(_padded(n, _F32, 2) for n in MODULE_NUMELS) // 2 * 4,
        "gradients": sum(_padded(n, _F32, 2) for n in MODULE_NUMELS) // 2 * 4,
        "master_parameters": 0,
        "optimizer_state": 0,
    },
}


def _conformance() -> dict:
    import os

    import zerotrain

    rank = int(os.environ["RANK"])
    out = {}
    for name, (extra, _, _) in CASES.items():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, **extra}
        engine, *_ = zerotrain.initialize(model=model, optimizer=opt, config=cfg)
        stage = engine.zero_stage_object
        state = stage.sharded_state()
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
        loss = engine(x.to(next(model.parameters()).dtype)).float().square().mean()
        engine.backward(loss)
        norm = float(stage.grad_norm())
        engine.step()
        weights = engine.module_state_dict()
        out[name] = {
            "type": type(stage).__name__,
            "instance": isinstance(stage, StageInterface),
            "stage": stage.stage,
            "engine_stage": engine.zero_optimization_stage(),
            "coordinator": stage.parameter_coordinator is not None,
            "state": isinstance(state, ShardedState),
            "units": len(state.units),
            "unit_names": sorted(n for u in state.units for n in u.names),
            "shard_rank": state.shard_rank,
            "swapper": state.optimizer_swapper,
            "statistics": stage.statistics(engine.module, engine.optimizer),
            "norm": norm,
            "weights": {k: v.float() for k, v in weights.items()},
        }
        engine.destroy()
    return out


def test_every_stage_object_conforms_and_the_engine_uses_it():
    results = run_on_ranks(_conformance, 2)
    names = [n for n, _ in _model().named_parameters()]
    for rank, out in enumerate(results):
        for name, (_, expected_type, stage) in CASES.items():
            got = out[name]
            assert got["type"] == expected_type and got["instance"], name
            assert got["stage"] == got["engine_stage"] == stage, name
            stats = got["statistics"]
            assert isinstance(stats, StageStatistics), name
            assert got["state"] and got["swapper"] is None and stats.offload == {}, name
            assert got["coordinator"] == (stage == 3), name
            assert {"parameters", "gradients", "optimizer_state"} <= set(stats.memory), name
            assert {k: stats.memory.get(k) for k in EXPECTED_MEMORY[name]} == EXPECTED_MEMORY[name], name
            if stage == 3:  # one module's unit gathered at a time; none after the step's use
                largest = _padded(max(MODULE_NUMELS), torch.float32, 2) * 4
                assert stats.gathers == GatherStatistics(
                    **{**vars(stats.gathers), "gathered_bytes": 0, "peak_gathered_bytes": largest}
                ), name
                assert stats.memory["peak_gathered_parameters"] == largest, name
            else:
                assert stats.gathers is None, name
            if expected_type == "ReplicatedGradients":
                assert got["units"] == 0 and got["shard_rank"] == 0, name
            else:  # every trained parameter is in a unit; sharded from stage 1
                assert got["unit_names"] == sorted(names), name
                assert got["shard_rank"] == (rank if stage >= 1 else 0), name
            # each rank feeds the same batch in every case: the same averaged gradient norm
            assert got["norm"] == pytest.approx(out["fp32 stage 0"]["norm"], rel=2e-2), name
    for name in CASES:  # the weights agree between ranks (stage 3: rank 0 gathers them)
        if results[1][name]["weights"]:
            for k, v in results[0][name]["weights"].items():
                assert torch.equal(v, results[1][name]["weights"][k]), (name, k)
        assert sorted(results[0][name]["weights"]) == sorted(names), name
