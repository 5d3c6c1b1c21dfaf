"""transformers.Trainer on zerotrain (seed 002's flow), through transformers' own DeepSpeed code.

One 2-rank group runs every zerotrain Trainer case; one 1-rank process runs the plain Trainer
(no DeepSpeed, no zerotrain) on the same global batches as the reference.

Tolerance for fp32 losses: rel 1e-5. Both runs compute the same math; they differ only in the
order fp32 sums are formed (two ranks' gradients averaged by one all-reduce vs one batch of 4),
which moves the loss by a few ulp per step (~1e-7 relative) over these 4 steps. A real bug (a
missing average, wrong GA scaling, a lost update) moves it by > 1e-3.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

from tests.hf.hf_workloads import (GAS, MICRO, STEPS, TINY_GPT2, WORLD, plain_reference,  # noqa: E402
                                   zerotrain_trainer_runs)
from zerotrain.testing import run_on_ranks  # noqa: E402

REL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_trainer")
    reference = run_on_ranks(plain_reference, world_size=1, args=(str(root / "plain"),), timeout=240)[0]
    ranks = run_on_ranks(zerotrain_trainer_runs, world_size=WORLD, args=(str(root),), timeout=240)
    return root, reference, ranks


def test_trainer_runs_zerotrain_engine_with_auto_values_filled(runs):
    _, _, ranks = runs
    result = ranks[0]
    assert result["engine_type"] == "zerotrain.engine.engine.ZeroTrainEngine"
    assert result["batch"] == (MICRO, GAS, MICRO * GAS * WORLD, 3)
    filled, hidden = result["filled"], TINY_GPT2["n_embd"]
    zero = filled["zero_optimization"]
    table = {  # config key: (filled value, value it must come from)
        "train_micro_batch_size_per_gpu": (filled["train_micro_batch_size_per_gpu"], MICRO),
        "gradient_accumulation_steps": (filled["gradient_accumulation_steps"], GAS),
        "train_batch_size": (filled["train_batch_size"], MICRO * GAS * WORLD),
        "gradient_clipping": (filled["gradient_clipping"], 1.0),
        "bf16.enabled": (filled["bf16"]["enabled"], False),
        "reduce_bucket_size": (zero["reduce_bucket_size"], hidden * hidden),
        "stage3_prefetch_bucket_size": (zero["stage3_prefetch_bucket_size"], int(0.9 * hidden * hidden)),
        "stage3_param_persistence_threshold": (zero["stage3_param_persistence_threshold"], 10 * hidden),
    }
    assert {k: v[0] for k, v in table.items()} == {k: v[1] for k, v in table.items()}


def test_stage3_and_stage2_losses_match_plain_trainer(runs):
    _, (plain, _), ranks = runs
    assert len(plain) == STEPS
    for name in ("z3", "z2"):
        assert ranks[0][name] == ranks[1][name]
        assert ranks[0][name] == pytest.approx(plain, rel=REL), name


def test_resume_from_checkpoint_continues_with_same_losses(runs):
    _, _, ranks = runs
    # log_history comes back from the checkpoint for steps 1-2; steps 3-4 are recomputed.
    assert ranks[0]["resumed"] == pytest.approx(ranks[0]["z3"], rel=1e-6)


def test_save_model_at_stage3_loads_with_from_pretrained(runs):
    from transformers import GPT2LMHeadModel

    root, (_, plain_weights), ranks = runs
    loaded = GPT2LMHeadModel.from_pretrained(root / "final").state_dict()
    gathered = ranks[0]["gathered"]
    assert set(loaded) <= set(gathered)
    for key, value in loaded.items():
        assert torch.equal(value, gathered[key]), key
        # The trained weights are the plain Trainer's (fp32, same tolerance argument as the losses).
        torch.testing.assert_close(value, plain_weights[key], rtol=1e-4, atol=1e-5)


def test_values_contradicting_training_arguments_are_one_error_listing_all(runs):
    message = runs[2][0]["mismatch"]
    assert message is not None
    for fragment in ("train_micro_batch_size_per_gpu=3", "gradient_accumulation_steps=2",
                     "train_batch_size", "gradient_clipping=0.5", "fp16.enabled=True",
                     "optimizer.params.lr=0.0001", "optimizer.params.betas=[0.8, 0.9]"):
        assert fragment in message, fragment


def test_hf_deepspeed_config_before_from_pretrained_loads_partitioned(runs):
    for result in runs[2]:
        assert result["pretrained_local_numel"] == 0
        assert result["pretrained_mismatched"] == []
