"""The estimator against the seeds' worked numbers (no processes spawned)."""

from __future__ import annotations

import pytest

from zerotrain.estimate import (
    Hardware,
    Settings,
    Workload,
    estimate,
    fine_tuning_rows,
    formula_activations,
    from_hf_config,
    from_params,
    stage_bytes,
)
from zerotrain.estimate.units import GiB, parse_bytes, parse_count

# Seed 001's BLOOM-560m: 24 layers, hidden 1024, 16 heads, vocab 250880 (559,214,592 parameters).
BLOOM = {"model_type": "bloom", "vocab_size": 250880, "hidden_size": 1024, "n_layer": 24, "n_head": 16}
LLAMA2_7B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": False,
}


def within(value: float, want: float, rel: float) -> bool:
    return abs(value - want) <= rel * want


def bloom_fp32(world: int, stage: int):
    shape = from_hf_config(BLOOM)
    return shape, stage_bytes(stage, shape, Settings(world_size=world, precision="fp32", optimizer="adam"))


def test_bloom_560m_matches_seed_001():
    shape, s0 = bloom_fp32(1, 0)
    assert shape.params == 559_214_592  # seed 001's printed parameter count, exactly
    # Seed 001: M_model = 4nh(13 + 12h) for the layers, plus the embedding: ~2.24 GB in fp32.
    n, h = 24, 1024
    assert 4 * n * h * (13 + 12 * h) + 4 * 250880 * h + 4 * 4 * h == 4 * shape.params
    assert within(s0.parameters / 1e9, 2.24, 0.03)
    assert within(s0.optimizer_state / 1e9, 4.48, 0.03)  # Adam: 8 bytes per parameter
    act = formula_activations(shape, micro_batch=1, seq_len=512, element_size=4)
    assert within(act.layers / 1e9, 1.75, 0.03)  # n·b·l·h·(67 + 9ml/h)
    assert act.layers == 24 * 1 * 512 * 1024 * (67 + 9 * 16 * 512 // 1024)


def test_bloom_zero1_and_zero2_arithmetic_for_8_gpus():
    shape, s1 = bloom_fp32(8, 1)
    act = formula_activations(shape, 1, 512, 4).layers
    # Seed 001: 2.24 + 2.24 + 0.56 + 1.75 = 6.79 GB at stage 1 on 8 GPUs.
    assert within(s1.parameters / 1e9, 2.24, 0.03) and within(s1.gradients / 1e9, 2.24, 0.03)
    assert within(s1.optimizer_state / 1e9, 0.56, 0.03)
    assert within((s1.model_states + act) / 1e9, 6.79, 0.03)
    # ... and 2.24 + 2.24/8 + 4.48/8 + 1.75 = 4.83 GB at stage 2.
    _, s2 = bloom_fp32(8, 2)
    assert within((s2.model_states + act) / 1e9, 4.83, 0.03)
    # Stage 0: 2.24 + 2.24 + 4.48 + 1.75 = 10.71 GB (seed: "very close to the 10.71GB we estimated").
    _, s0 = bloom_fp32(8, 0)
    assert within((s0.model_states + act) / 1e9, 10.71, 0.03)


def test_seed_002_7b_model_states_and_what_fits():
    est = estimate(
        from_params(parse_count("7e9")),
        Hardware(gpus_per_node=4, gpu_memory=parse_bytes("80GiB")),
        Workload(),
        Settings(world_size=4, precision="bf16"),
    )
    # "Without offloading, you'd need roughly 112GB of GPU memory just for the model states."
    assert est.row(0).gpu["model_states"] == 16 * 7_000_000_000
    assert est.row(0).fits_gpu is False
    # Stage 3 with CPU offload of optimizer and parameters (the seed's config) leaves the GPU
    # only the gathered window; its host side is DeepSpeed's 18 bytes per parameter per node.
    off = est.row(3, "optimizer_params_cpu")
    assert off.gpu["model_states"] == 0 and off.fits_gpu
    assert off.cpu_per_node["offloaded"] == 18 * 7_000_000_000
    rec = est.recommendation
    assert rec.row is not None and rec.row.offload == "none"  # never recommends what raises
    # On 4 x 80 GiB, ZeRO-1 already fits the model states (7 bytes/param = 49 GB per GPU).
    assert rec.row.stage == 1 and est.row(1).gpu["model_states"] == 7 * 7_000_000_000


def test_7b_where_nothing_fits_points_at_offload_rows_it_does_not_recommend():
    shape = from_hf_config(LLAMA2_7B)
    assert shape.params == 6_738_415_616  # LLaMA-2-7B's count
    # 4 x 23 GiB: the replicated 16-bit weights (12.6 GiB) still fit, so the least offloading
    # that fits is stage 1 with the optimizer on the host. (At 24 GiB stage 3 fits with
    # activation checkpointing: it keeps no 16-bit shard beside the fp32 master, 14 bytes per
    # parameter / 4 = 22.0 GiB of model states.)
    est = estimate(
        shape,
        Hardware(gpus_per_node=4, gpu_memory=23 * GiB),
        Workload(micro_batch=1, seq_len=512),
        Settings(world_size=4, precision="bf16"),
    )
    assert [est.row(s).fits_gpu for s in range(4)] == [False, False, False, False]
    rec = est.recommendation
    assert rec.row is None and est.ds_config() is None
    assert (rec.offload_alternative.stage, rec.offload_alternative.offload) == (1, "optimizer_cpu")
    assert any("follow DeepSpeed's placement" in line for line in rec.steps)
    assert "does not fit without offload" in est.text()
    # 16-bit stage 3 keeps no 16-bit shard beside the fp32 master (gathers cast it), except
    # where the master is offloaded to the host: then the GPU keeps the 16-bit shard.
    kept = est.row(3, "optimizer_cpu").gpu["parameters"] - est.row(3).gpu["parameters"]
    assert 2 * shape.params // 4 * 0.99 < kept <= 2 * shape.params // 4 + 2 * 4096
    assert est.row(3).gpu["parameters"] < 2 * shape.params // 4 / 1000  # the small units only
    # 8 x 12 GiB: even one replica of the weights is too much: stage 3 with offload, as seed 002.
    est = estimate(
        shape,
        Hardware(gpus_per_node=8, gpu_memory=12 * GiB),
        Workload(micro_batch=1, seq_len=512),
        Settings(world_size=8, precision="bf16"),
    )
    alt = est.recommendation.offload_alternative
    assert est.recommendation.row is None and (alt.stage, alt.offload) == (3, "optimizer_cpu")
    assert "stage 3, offload optimizer->cpu" in est.text()


def test_why_it_does_not_fit_names_activations_and_checkpointing():
    est = estimate(
        from_hf_config(LLAMA2_7B),
        Hardware(gpus_per_node=8, gpu_memory=48 * GiB),
        Workload(micro_batch=8, seq_len=2048),
        Settings(world_size=8, precision="bf16"),
    )
    first = est.recommendation.steps[0]
    assert first.startswith("stage 0 does not fit")
    assert "activations: " in first and "at micro-batch 8; with activation checkpointing" in first
    rec = est.recommendation
    assert rec.row is not None and rec.row.offload == "none"
    if rec.row.micro_batch == 8:
        assert rec.row.activation_checkpointing
    else:
        assert rec.gradient_accumulation_steps * rec.row.micro_batch >= 8
    assert rec.max_micro_batch >= rec.row.micro_batch
    assert est.row(rec.row.stage).fits_gpu is not None


def test_activation_checkpointing_keeps_layer_inputs_plus_one_layer():
    shape = from_hf_config(BLOOM)
    full = formula_activations(shape, 4, 1024, 2)
    ckpt = formula_activations(shape, 4, 1024, 2, checkpointing=True)
    sbh = 4 * 1024 * 1024
    assert ckpt.layers == 24 * sbh * 2 + full.layers // 24
    assert ckpt.logits == full.logits == 4 * 1024 * 250880 * (2 + 4)


def test_largest_micro_batch_is_the_boundary():
    est = estimate(
        from_hf_config(BLOOM),
        Hardware(gpus_per_node=8, gpu_memory=16 * GiB),
        Workload(micro_batch=1, seq_len=512),
        Settings(world_size=8, precision="fp32", optimizer="adam"),
    )
    rec = est.recommendation
    assert rec.row.stage == 0  # 10.7 GB + buffers fits 16 GiB, as seed 001 measured on V100s
    from zerotrain.estimate.planner import build_row

    def fits(m):
        return build_row(
            0,
            "none",
            est.shape,
            est.settings,
            est.hardware,
            m,
            False,
            lambda mb, c: formula_activations(est.shape, mb, 512, 4, c),
            512 * 250880 * 4,
        ).fits

    assert fits(rec.max_micro_batch) and not fits(rec.max_micro_batch + 1)


def test_seed_000_rules_of_thumb_rows():
    rows = {r.method.split(" (")[0].split(",")[0]: r for r in fine_tuning_rows()}
    assert rows["full fine-tuning"].rule_bits_per_param == 12 * 8
    assert rows["full fine-tuning"].refined_bits_per_param == 16 * 8
    assert rows["LoRA"].rule_bits_per_param == pytest.approx(17.6)
    assert rows["QLoRA"].rule_bits_per_param == pytest.approx(5.6)
    load = rows["load 16-bit weights"]
    assert load.rule_bytes(7e9) == 14e9  # "2 x params (B) = GB": 7B -> 14 GB
    text = estimate(from_params(7_000_000_000)).text()
    assert "rule    84.00 GB | refined   112.00 GB" in text


def test_deepspeed_helpers_print_deepspeeds_table(capsys):
    from torch import nn

    from zerotrain.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_live,
    )
    from zerotrain.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_live,
    )

    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))  # 1,011,010 parameters
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=4, num_nodes=1)
    out = capsys.readouterr().out
    assert "HW: Setup with 1 node, 4 GPUs per node." in out and "per CPU  |  per GPU" in out
    cpu, gpu = estimate_zero2_model_states_mem_needs(1_011_010, 4, 1, cpu_offload=False)
    assert gpu == 4 * 1_011_010 + int(16 * 1_011_010 / 4) and cpu == int(1_011_010 * 4 * 4 * 1.5)
    assert f"{gpu / GiB:6.2f}GB | offload_optimizer=none" in out
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2, num_nodes=2)
    out = capsys.readouterr().out
    cpu, gpu, largest = estimate_zero3_model_states_mem_needs(1_011_010, 1_001_000, 2, 2, True, True, True)
    assert largest == 4 * 1_001_000 and gpu == largest and cpu == int(1_011_010 * 18 / 2 * 1.5)
    assert "offload_param=cpu , offload_optimizer=cpu , zero_init=1" in out
    assert "zerotrain (bf16 + AdamW, no offload)" in out


def test_sizes_and_bad_input_name_the_flag():
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("80GB") == 80 * 10**9
    assert parse_count("560M") == 560_000_000 and parse_count("7B") == 7 * 10**9
    with pytest.raises(ValueError, match="--gpu-memory"):
        parse_bytes("lots", "--gpu-memory")
    with pytest.raises(ValueError, match="--hf-config: the config has no num_attention_heads"):
        from_hf_config({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10})
    with pytest.raises(ValueError, match="--optimizer"):
        Settings(world_size=1, optimizer="adafactor")
