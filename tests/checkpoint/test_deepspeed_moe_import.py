"""``zerotrain convert-deepspeed`` of a DeepSpeed 0.19.8 MoE checkpoint (issue 32).

The fixture (tests/checkpoint/fixtures/deepspeed/moe-stage2, 84 kB, made by
fixtures/make_deepspeed_moe_fixture.py) is DeepSpeed's ZeRO-2 fp32 AdamW checkpoint of a model with
two MoE layers at ep_size 2 on 4 ranks (two expert-data replicas; 4 experts with a persistent
buffer, and 2), with DeepSpeed's losses of the 2 steps after the save. Converted, it must hold
the single-process model's names with DeepSpeed's values (every expert under its global id), and
a zerotrain engine on one rank at ep_size 1 (every expert local) must continue with DeepSpeed's
losses (which depend on the converted Adam moments and step).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from tests.checkpoint.fixtures import make_deepspeed_moe_fixture as fixture
from zerotrain.testing import run_on_ranks

warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)

FOLDER = Path(__file__).parent / "fixtures" / "deepspeed" / "moe-stage2"
EXPECTED = json.loads((FOLDER / "expected.json").read_text())


def _zerotrain_model():
    from zerotrain.moe.layer import MoE

    return fixture.make_model(MoE, ep_size=1)


def _continue(converted: str, load_optimizer: bool):
    import zerotrain
    from zerotrain.moe.utils import split_params_into_different_moe_groups_for_optimizer

    zerotrain.init_distributed()
    model = _zerotrain_model()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    optimizer = torch.optim.AdamW(groups, lr=2e-2, weight_decay=0.1, eps=1e-6)  # the fixture's
    world = EXPECTED["world_size"]
    engine, *_ = zerotrain.initialize(
        model=model,
        optimizer=optimizer,
        config={"train_micro_batch_size_per_gpu": world * fixture.TOKENS, "zero_optimization": {"stage": 2}},
    )
    engine.load_checkpoint(converted, load_optimizer_states=load_optimizer)
    data = fixture.batches(world)
    losses = []
    for step in range(fixture.BEFORE, fixture.BEFORE + fixture.AFTER):
        # the mean over all tokens: DeepSpeed's mean over its ranks of each rank's mean
        loss = engine(data[step]).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out = {"losses": losses, "lr": engine.get_lr()}
    engine.destroy()
    return out


def test_deepspeed_moe_checkpoint_converts_by_global_expert_id(tmp_path):
    from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint
    from zerotrain.checkpoint.deepspeed_files import safe_load
    from zerotrain.checkpoint.deepspeed_import import convert_deepspeed_checkpoint

    converted = convert_deepspeed_checkpoint(FOLDER, tmp_path / "zt")
    meta = json.loads((converted / "metadata.json").read_text())
    assert meta["moe"]["num_experts"] == [4, 2]
    assert [(m["module"], m["ep_size"], m["num_local_experts"]) for m in meta["moe"]["layers"]] == [
        ("moe", 2, 2),
        ("moe2", 2, 1),
    ]
    reference = _zerotrain_model().state_dict()
    assert meta["keys"] == list(reference)
    # DeepSpeed's own values: the dense module and every expert file (fp32: weights = masters)
    want = dict(safe_load(FOLDER / "global_step2" / "mp_rank_00_model_states.pt")["module"])
    for path in sorted((FOLDER / "global_step2").glob("layer_*_expert_*_mp_rank_00_model_states.pt")):
        want.update(safe_load(path))
    assert sorted(want) == sorted(reference)
    got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "zt"))
    assert list(got) == list(reference)
    for name, value in want.items():
        assert torch.equal(got[name], value.float()), name
    assert not torch.equal(
        got["moe.deepspeed_moe.experts.deepspeed_experts.1.lin.weight"],
        got["moe.deepspeed_moe.experts.deepspeed_experts.2.lin.weight"],
    )

    # one rank, ep_size 1: DeepSpeed's next losses; without the optimizer state the second differs
    with_state, without = run_on_ranks(_continue_both, 1, args=(str(tmp_path / "zt"),), timeout=300)[0]
    for got_loss, ds_loss in zip(with_state["losses"], EXPECTED["losses_after"]):
        assert abs(got_loss - ds_loss) <= 1e-5 * abs(ds_loss), (with_state["losses"], EXPECTED["losses_after"])
    assert abs(without["losses"][0] - EXPECTED["losses_after"][0]) <= 1e-5 * EXPECTED["losses_after"][0]
    assert abs(without["losses"][1] - EXPECTED["losses_after"][1]) > 1e-3 * EXPECTED["losses_after"][1]


def _continue_both(converted: str):
    return _continue(converted, True), _continue(converted, False)
