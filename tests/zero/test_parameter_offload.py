"""DeepSpeed's stage-3 hook handles as TRL uses them to generate (zero/parameter_offload.py).

TRL's own ``remove_hooks``/``add_hooks`` (trl.models.utils) run between training steps inside
``GatheredParameters(engine.parameters())``, as its ``unwrap_model_for_generation`` does, on 2
gloo ranks:
- with the hooks removed, forwards gather nothing and issue no collective (the ranks run
  different numbers of them) and give the logits the hooked engine gives;
- ``add_hooks`` invalidates the recorded order and puts the hooks back; training then matches a
  single-process fp32 reference (losses and every weight), with SGD and with AdamW;
- ``ds_active_sub_modules`` names the running modules that use a parameter, ``clear()`` empties
  it; ``ds_external_parameters()`` lists ``register_external_parameter``'s parameters;
- ``zero.named_full_parameters`` hands out every parameter whole, equal to the consolidated
  state dict, with at most two units gathered (the one handed out, the next in flight) and none
  left after it ends or is closed early;
- ``destroy()`` removes ``optimizer.parameter_offload``, the modules' method and the parameters'
  attribute.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import reference_run
from zerotrain.testing import run_on_ranks

pytest.importorskip("trl")

STEPS, MICRO = 3, 2
OPTIMIZERS = {
    "sgd": {"type": "SGD", "params": {"lr": 0.1}},
    "adamw": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
}


def _train(name: str, optimizer: dict) -> dict:
    import torch.distributed as dist
    from trl.models.utils import add_hooks, remove_hooks

    import zerotrain
    from tests.engine.workloads import global_batches, make_model
    from zerotrain.zero.partition import FlatParamUnit

    zerotrain.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": optimizer,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, opt, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    offload = opt.parameter_offload
    data = global_batches(STEPS, MICRO * world)
    prompt = data[0, :1, :8]
    gathers = []
    start_gather = FlatParamUnit.start_gather

    def counting(unit, *args, **kwargs):
        gathers.append(unit)
        return start_gather(unit, *args, **kwargs)

    FlatParamUnit.start_gather = counting
    result = {"losses": [], "generation_gathers": [], "same_logits": [], "hooks": [], "invalid_after_add": []}
    block = next(m for m in engine.module.blocks[0].modules() if list(m.parameters(recurse=False)))
    seen = {}
    block_param = next(block.parameters())

    def note_active(module, args):
        seen.setdefault(
            "active", (len(block_param.ds_active_sub_modules), id(module) in block_param.ds_active_sub_modules)
        )

    handle = block.register_forward_pre_hook(note_active)
    try:
        for step in range(STEPS):
            batch = data[step, rank * MICRO : (rank + 1) * MICRO]
            engine.train()
            loss = engine(batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            result["losses"].append(total.item() / world)
            engine.eval()
            with torch.no_grad():
                hooked = engine(prompt).logits
            with zerotrain.zero.GatheredParameters(engine.parameters()):
                remove_hooks(engine)
                before = len(gathers)
                result["hooks"].append(len(offload.forward_hooks))
                with torch.no_grad():
                    outs = [engine.module(prompt).logits for _ in range(rank + 1)]  # ranks differ
                result["same_logits"].append(all(torch.equal(o, hooked) for o in outs))
                result["generation_gathers"].append(len(gathers) - before)
                add_hooks(engine)
                result["invalid_after_add"].append(offload.param_coordinator.is_invalid_trace())
            result["hooks"].append(len(offload.forward_hooks))
    finally:
        FlatParamUnit.start_gather = start_gather
        handle.remove()
    result["active_in_forward"] = seen["active"]
    result["active_between"] = len(block_param.ds_active_sub_modules)
    extra = engine.module.lm_head.weight if hasattr(engine.module, "lm_head") else block_param
    zerotrain.zero.register_external_parameter(block, extra)
    result["external"] = [p is extra for _, p in block.ds_external_parameters()]
    zerotrain.zero.unregister_external_parameter(block, extra)
    result["external_after"] = len(block.ds_external_parameters())
    coordinator = engine.zero_stage_object.parameter_coordinator
    in_memory = []  # units gathered while each parameter is handed out
    streamed = {}
    for name, tensor in zerotrain.zero.named_full_parameters(engine):
        in_memory.append(sum(u.gathered for u in coordinator.units))
        streamed[name] = tensor.clone()
    result["streamed"], result["streamed_in_memory"] = streamed, in_memory
    result["gathered_after_stream"] = sum(u.gathered for u in coordinator.units)
    early = zerotrain.zero.named_full_parameters(engine)
    next(early)
    early.close()  # a consumer that stops: what it gathered, or started to, is released
    result["gathered_after_close"] = sum(u.gathered for u in coordinator.units)
    result["names"] = [n for n, _ in model.named_parameters()]
    state = engine.module_state_dict()
    consolidated = engine._consolidated_16bit_state_dict()  # DeepSpeed's general name (accelerate, OpenRLHF)
    result["consolidated"] = (
        None
        if consolidated is None
        else all(torch.equal(consolidated[k], v) for k, v in state.items()) and consolidated.keys() == state.keys()
    )
    engine.destroy()
    result["state"] = {k: v.clone() for k, v in state.items()}
    result["after_destroy"] = [
        hasattr(opt, "parameter_offload"),
        any("ds_external_parameters" in vars(m) for m in model.modules()),
        any(hasattr(p, "ds_active_sub_modules") for p in model.parameters()),
    ]
    return result


def _both():
    return {name: _train(name, optimizer) for name, optimizer in OPTIMIZERS.items()}


def test_trl_generation_hooks_round_trip_and_training_matches_reference():
    ranks = run_on_ranks(_both, world_size=2, timeout=240)
    for name, optimizer in OPTIMIZERS.items():
        losses, state = reference_run(STEPS, MICRO * 2, optimizer)
        for rank, runs in enumerate(ranks):
            got = runs[name]
            assert got["generation_gathers"] == [0] * STEPS, (name, rank)
            assert got["same_logits"] == [True] * STEPS, (name, rank)
            # removed inside the context, back after add_hooks (pre and post hook per module)
            assert all(h == 0 for h in got["hooks"][0::2]) and all(h > 0 for h in got["hooks"][1::2])
            assert got["invalid_after_add"] == [True] * STEPS
            assert got["active_in_forward"] == (1, True) and got["active_between"] == 0
            assert got["external"] == [True] and got["external_after"] == 0
            assert got["after_destroy"] == [False, False, False]
            assert got["consolidated"] is (True if rank == 0 else None)
            assert got["losses"] == pytest.approx(losses, rel=1e-5)
        for rank, runs in enumerate(ranks):  # named_full_parameters: each whole, a unit at a time
            got = runs[name]
            assert list(got["streamed"]) == got["names"] and len(got["names"]) > 10
            for key, tensor in got["streamed"].items():
                assert torch.equal(tensor, ranks[0][name]["state"][key]), (name, rank, key)
            assert max(got["streamed_in_memory"]) == 2 and got["streamed_in_memory"][-1] == 1
            assert got["gathered_after_stream"] == 0 and got["gathered_after_close"] == 0
        compared = ranks[0][name]["state"]
        assert set(compared) == set(state)
        for key, want in state.items():
            torch.testing.assert_close(compared[key], want, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
