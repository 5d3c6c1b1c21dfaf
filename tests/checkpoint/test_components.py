"""The engine's checkpointed components (``engine.checkpoint_components()``, torch's ``Stateful``
protocol, ``zerotrain.checkpoint.stateful``): what a checkpoint stores and restores of the
engine's small state, with no probe of the engine.

Checked here: the protocol is torch's member for member; an engine with every component (fp16
dynamic loss scaler, LR scheduler, dataloader position, PLD) declares them in the format's order;
the per-rank state file holds exactly the keys of the format (a fixed list, as written before the
components existed), each the component's ``state_dict()``; loading a component's saved state
through the mapping restores what the engine reports; ``load_checkpoint`` restores through the
mapping (a stand-in component receives the saved state and the engine's own part is untouched);
and a static check over ``src/`` finds no ``getattr``/``hasattr``/``setattr`` on an engine and
no ``is_pipeline_engine`` outside engine/ (and zero/, the stage's package).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

from zerotrain.testing import run_on_ranks

SRC = Path(__file__).resolve().parents[2] / "src" / "zerotrain"
OWN_PACKAGES = ("engine", "zero")

# The format, as the state file and folder were written before the components existed.
STATE_KEYS = ["rank", "world_size", "scalars", "param_groups", "engine", "rng", "client_state"]
ENGINE_KEYS = {
    "counters": ["global_steps", "global_samples", "skipped_steps", "micro_steps"],
    "loss_scaler": ["cur_scale", "cur_hysteresis", "cur_iter", "last_overflow_iter"],
    "lr_scheduler": ["last_batch_iteration"],
    "dataloader": ["epoch", "batches", "batch_size", "world_size"],
    "pld": ["current_theta"],
}
FILES = [
    "metadata.json",
    "model.safetensors",
    "shards.rank00000.safetensors",
    "state.rank00000.pt",
    "zero_to_fp32.py",
    "zerotrain_checkpoint_format.py",
]


# -- the static rule ---------------------------------------------------------------------------
def _on_engine(node: ast.AST) -> bool:
    """Whether ``node`` is an engine or reached through one: ``engine``, ``engine.config``,
    ``self.engine``, ``x.engine.lr_scheduler``."""
    while isinstance(node, ast.Attribute):
        if node.attr == "engine":
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id == "engine"


def engine_probes(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and node.args
            and _on_engine(node.args[0])
        ):
            found.append((node.lineno, ast.unparse(node)))
        if (isinstance(node, ast.Attribute) and node.attr == "is_pipeline_engine") or (
            isinstance(node, ast.Constant) and node.value == "is_pipeline_engine"
        ):
            found.append((node.lineno, "is_pipeline_engine"))
    return found


def violations(root: Path = SRC) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in OWN_PACKAGES:
            continue
        for line, detail in engine_probes(ast.parse(path.read_text(), filename=str(path))):
            out.append(f"{rel.as_posix()}:{line}: {detail}")
    return out


def test_no_probe_of_the_engine_outside_its_package():
    found = violations()
    assert not found, "the engine is probed outside engine/:\n" + "\n".join(found)


def test_the_static_check_finds_probes(tmp_path):
    for folder in ("checkpoint", "monitor", "engine"):
        (tmp_path / folder).mkdir()
    (tmp_path / "checkpoint" / "bad.py").write_text(
        "def f(engine):\n    return getattr(engine, 'training_dataloader', None)\n\n"
        "def g(engine):\n    return hasattr(engine.lr_scheduler, 'state_dict')\n\n"
        "def h(self):\n    return getattr(self, 'is_pipeline_engine', False)\n"
    )
    (tmp_path / "monitor" / "bad.py").write_text("def f(self):\n    return getattr(self.engine.config, 'fp16')\n")
    (tmp_path / "engine" / "own.py").write_text("def f(engine):\n    return getattr(engine, 'x', None)\n")
    assert violations(tmp_path) == [
        "checkpoint/bad.py:2: getattr(engine, 'training_dataloader', None)",
        "checkpoint/bad.py:5: hasattr(engine.lr_scheduler, 'state_dict')",
        "checkpoint/bad.py:8: is_pipeline_engine",
        "monitor/bad.py:2: getattr(self.engine.config, 'fp16')",
    ]


def test_the_protocol_is_torchs():
    from torch.distributed.checkpoint.stateful import Stateful as TorchStateful

    from zerotrain.checkpoint.stateful import Stateful

    members = {n for n in vars(TorchStateful) if not n.startswith("_")}
    assert members == {n for n in vars(Stateful) if not n.startswith("_")} == {"state_dict", "load_state_dict"}
    for name in members:
        assert list(inspect.signature(getattr(Stateful, name)).parameters) == list(
            inspect.signature(getattr(TorchStateful, name)).parameters
        )


# -- a live engine -----------------------------------------------------------------------------
class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(1, generator=g)


def _config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
        "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1},
        "zero_optimization": {"stage": 1},
        "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.1},
    }


def _build(seed: int):
    import zerotrain
    from tests.pld.models import PLDNet

    model = PLDNet(seed=seed)
    engine, _, loader, _ = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config=_config(), training_data=_Rows()
    )
    return engine, loader


def _observed(engine, loader) -> dict:
    """What the engine reports of each component's state (the scheduler's lr for the scheduler: the
    optimizer's lr is the optimizer's state)."""
    return {
        "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps),
        "loss_scale": engine.loss_scale,
        "lr": engine.lr_scheduler.get_lr(),
        "theta": float(engine.get_pld_theta()),
        "loader": loader.state_dict(),
    }


def _components(folder: str):
    from torch.distributed.checkpoint.stateful import Stateful as TorchStateful

    from tests.pld.models import batches
    from zerotrain.checkpoint.format import CheckpointReader
    from zerotrain.checkpoint.training_state import read_rank_state

    engine, loader = _build(0)
    batches_iter = iter(loader)
    next(batches_iter), next(batches_iter)  # the dataloader is 2 batches into epoch 0
    for x, y in batches(6, 2):  # 3 steps of 2 micro-batches
        engine.backward(engine(x, y))
        engine.step()
    components = engine.checkpoint_components()
    declared = list(components)
    torch_protocol = all(isinstance(c, TorchStateful) for c in components.values())
    live_state = {name: c.state_dict() for name, c in components.items()}
    saved_view = _observed(engine, loader)
    engine.save_checkpoint(folder, tag="t")
    tag = Path(folder) / "t"
    files = sorted(p.name for p in tag.iterdir())
    raw = torch.load(tag / "state.rank00000.pt", map_location="cpu", weights_only=True)
    layout = {"state": list(raw), "engine": {k: list(v) for k, v in raw["engine"].items()}}
    reader = CheckpointReader(tag)
    saved = read_rank_state(reader, "state.rank00000.pt")["engine"]
    reader.close()

    # Each component loaded through a fresh engine's mapping restores what that engine reports.
    fresh, fresh_loader = _build(5)
    fresh_before = _observed(fresh, fresh_loader)
    for name, component in fresh.checkpoint_components().items():
        component.load_state_dict(saved[name])
    fresh_after = _observed(fresh, fresh_loader)

    # load_checkpoint restores through the mapping: a stand-in loss scaler component gets the saved
    # state, and the engine's own scaler (not in the mapping now) keeps its initial scale.
    class Recording:
        def __init__(self):
            self.loaded = []

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            self.loaded.append(dict(state_dict))

    third, third_loader = _build(7)
    recording, declared_by_engine = Recording(), third.checkpoint_components
    third.checkpoint_components = lambda: {**declared_by_engine(), "loss_scaler": recording}
    initial_scale = third.loss_scale
    third.load_checkpoint(folder, tag="t")
    return {
        "declared": declared,
        "torch_protocol": torch_protocol,
        "files": files,
        "layout": layout,
        "live_state": live_state,
        "saved": saved,
        "saved_view": saved_view,
        "fresh_before": fresh_before,
        "fresh_after": fresh_after,
        "recorded": recording.loaded,
        "third_scale": (initial_scale, third.loss_scale),
        "third_view": _observed(third, third_loader),
    }


def test_components_are_what_a_checkpoint_saves_and_restores(tmp_path):
    (r,) = run_on_ranks(_components, 1, args=(str(tmp_path / "ckpt"),), timeout=300)
    assert r["declared"] == list(ENGINE_KEYS) and r["torch_protocol"]
    assert r["files"] == FILES
    assert r["layout"] == {"state": STATE_KEYS, "engine": ENGINE_KEYS}
    assert r["saved"] == r["live_state"]  # each key holds its component's state_dict()
    view = r["saved_view"]
    assert view["counters"] == (3, 12, view["counters"][2], 6) and view["loader"]["batches"] == 2
    assert r["fresh_before"] != view  # a fresh engine differs in every component ...
    for key in view:
        assert r["fresh_before"][key] != view[key], key
    assert r["fresh_after"] == view  # ... and the mapping's load_state_dict restores each
    assert r["recorded"] == [r["saved"]["loss_scaler"]]
    initial, after = r["third_scale"]
    assert initial == after == 2.0**8 != view["loss_scale"]
    third = dict(r["third_view"], loss_scale=view["loss_scale"])
    assert third == view  # every other component restored by load_checkpoint
