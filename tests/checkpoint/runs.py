"""The distributed runs behind tests/checkpoint: a few process groups, many checks each.

- ``save_runs`` (2 ranks): every stage x precision trains, saves, trains on (the reference);
  sources for universal reloads; an injected failure during a save; tag validation.
- ``load_runs`` (2 ranks, fresh processes): every saved run resumes; stage 1 -> stage 3.
- ``killed_save`` (2 ranks): rank 1 is SIGKILLed while writing a second checkpoint.
- ``single_rank_loads`` (1 rank) and ``four_rank_loads`` (4 ranks): reloads on other world sizes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from tests.checkpoint.workloads import STEPS, build, config, final_state, train

EXACT = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16", "fp16")]
ASYNC = (2, "bf16")  # saved with async_save=True


def exact_dir(root, stage, precision) -> str:
    return str(Path(root) / f"stage{stage}-{precision}")


def save_runs(root: str) -> dict:
    import torch.distributed as dist

    from zerotrain.checkpoint import save as save_module
    from zerotrain.checkpoint.format import CheckpointError

    out = {}
    for stage, precision in EXACT:
        engine = build(config(stage, precision), dropout=0.1)
        before = train(engine, STEPS)
        engine.save_checkpoint(
            exact_dir(root, stage, precision),
            client_state={"epoch": 3, "ids": torch.arange(4)},
            async_save=(stage, precision) == ASYNC,
        )
        # what consolidation must reproduce (copies: at stages 0-2 these are the live tensors)
        saved_weights = {k: v.clone() for k, v in engine.module_state_dict().items()}
        after = train(engine, STEPS)
        engine.wait_for_checkpoint()
        out[(stage, precision)] = {
            "before": before,
            "after": after,
            "final": final_state(engine),
            "saved_weights": saved_weights,
        }
        engine.destroy()
    for stage in (1, 2):  # sources of the universal reloads (no dropout: ranks would differ)
        engine = build(config(stage))
        train(engine, STEPS)
        engine.save_checkpoint(str(Path(root) / f"universal{stage}"))
        out[f"universal{stage}"] = {"after": train(engine, STEPS), "final": final_state(engine)}
        engine.destroy()

    # A save that fails on rank 1 mid-way: every rank raises, `latest` stays.
    engine = build(config(2))
    rank = dist.get_rank()
    train(engine, 1)
    failing = str(Path(root) / "failing")
    engine.save_checkpoint(failing, tag="good")
    real = save_module.write_safetensors

    def broken(path, tensors, metadata=None):
        if rank == 1:
            Path(path).write_bytes(b"partial")
            raise OSError("No space left on device (injected)")
        return real(path, tensors, metadata)

    save_module.write_safetensors = broken
    try:
        train(engine, 1)
        engine.save_checkpoint(failing, tag="bad")
        out["failure"] = "no error"
    except CheckpointError as error:
        out["failure"] = str(error)
    finally:
        save_module.write_safetensors = real
    out["failure_latest"] = (Path(failing) / "latest").read_text()
    out["failure_folders"] = sorted(os.listdir(failing))
    path, _ = engine.load_checkpoint(failing)
    out["failure_reload"] = (path, engine.global_steps)

    # checkpoint.tag_validation: Fail raises on disagreeing tags, Ignore lets them be.
    strict = build(config(1, checkpoint={"tag_validation": "Fail"}))
    try:
        strict.save_checkpoint(str(Path(root) / "tags"), tag=f"rank{rank}")
        out["tag_fail"] = "no error"
    except ValueError as error:
        out["tag_fail"] = str(error)
    return out


def load_runs(root: str) -> dict:
    out = {}
    for stage, precision in EXACT:
        engine = build(config(stage, precision), dropout=0.1)
        path, client = engine.load_checkpoint(exact_dir(root, stage, precision))
        after = train(engine, STEPS)
        out[(stage, precision)] = {"after": after, "final": final_state(engine), "client": client, "path": path}
        engine.destroy()
    engine = build(config(3))  # saved at stage 1 on 2 ranks, loaded at stage 3
    engine.load_checkpoint(str(Path(root) / "universal1"))
    out["1->3"] = {"after": train(engine, STEPS), "final": final_state(engine)}
    engine.destroy()
    engine = build(config(3, "bf16"))  # fp32 checkpoint into bf16 training: masters exact
    engine.load_checkpoint(str(Path(root) / "universal1"))
    masters = {}
    for unit in engine._zero.units:
        for piece in unit.layout.shard_pieces(engine._zero.shard_rank):
            name = unit.names[piece.slot.index]
            masters[(name, piece.param_start)] = unit.master.detach()[
                piece.shard_start : piece.shard_start + piece.numel
            ].clone()
    out["fp32->bf16"] = {"masters": masters, "weights": engine.module_state_dict(), "after": train(engine, 2)}
    return out


def killed_save(root: str) -> None:
    """Save "first", then die (rank 1, SIGKILL) half-way through writing "second"."""
    import torch.distributed as dist

    from zerotrain.checkpoint import save as save_module

    engine = build(config(2))
    train(engine, 2)
    engine.save_checkpoint(root, tag="first")
    real = save_module.write_safetensors

    def dying(path, tensors, metadata=None):
        if dist.get_rank() == 1:
            with open(path, "wb") as f:
                f.write(b"\x00" * 100)
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, tensors, metadata)

    save_module.write_safetensors = dying
    train(engine, 1)
    engine.save_checkpoint(root, tag="second")


def single_rank_loads(root: str, killed: str, corrupt: str) -> dict:
    from zerotrain.checkpoint.format import CheckpointError

    out = {}
    engine = build(config(0, micro=4))  # saved on 2 ranks at stage 2, loaded on 1 at stage 0
    engine.load_checkpoint(str(Path(root) / "universal2"))
    out["2->0"] = {"after": train(engine, STEPS), "final": final_state(engine)}
    engine = build(config(2))
    path, _ = engine.load_checkpoint(killed)
    out["killed"] = {
        "path": path,
        "steps": engine.global_steps,
        "weights": {k: v.clone() for k, v in engine.module_state_dict().items()},
    }
    try:
        engine.load_checkpoint(corrupt)
        out["corrupt"] = "no error"
    except CheckpointError as error:
        out["corrupt"] = str(error)
    import zerotrain
    from tests.engine.workloads import make_model

    other = make_model(vocab_size=80)  # the embedding and head have other shapes
    engine, *_ = zerotrain.initialize(model=other, model_parameters=other.parameters(), config=config(1))
    try:
        engine.load_checkpoint(str(Path(root) / "universal1"))
        out["mismatch"] = "no error"
    except CheckpointError as error:
        out["mismatch"] = str(error)
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine.load_checkpoint(str(Path(root) / "universal1"), load_module_strict=False)
    out["non_strict"] = {"before": before, "after": engine.module_state_dict()}
    return out


def four_rank_loads(root: str) -> dict:
    engine = build(config(3, micro=1))  # saved on 2 ranks at stage 2, loaded on 4 at stage 3
    engine.load_checkpoint(str(Path(root) / "universal2"))
    return {"after": train(engine, STEPS), "final": final_state(engine)}
