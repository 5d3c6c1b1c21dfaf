"""The FLOPs profiler: counts against a hand count of GPT-2's matmuls, DeepSpeed's API
(``zerotrain.profiling.flops_profiler``), the printout, and the engine's ``flops_profiler``
section on 2 ranks at ZeRO-3 (profile at the profile step only, step log TFLOPS/MFU)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.engine.workloads import adamw_config, global_batches, make_model
from zerotrain.testing import run_on_ranks

LAYERS, WIDTH, VOCAB, HEADS = 2, 64, 256, 4


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
        )
    )


def _hand_count(batch: int, seq: int) -> dict:
    """GPT-2's matmul FLOPs (2 per multiply-add): per block the qkv, output, and two MLP
    projections and the two attention products (over the whole T x T square: the kernels
    compute it and mask), then the output layer."""
    tokens, c = batch * seq, WIDTH
    attn_proj = 2 * tokens * c * 3 * c + 2 * tokens * c * c
    attn_products = 2 * (2 * batch * seq * seq * c)  # QK^T and AV over all heads
    mlp = 2 * (2 * tokens * c * 4 * c)
    block = attn_proj + attn_products + mlp
    return {
        "block": block,
        "attn": attn_proj + attn_products,
        "mlp": mlp,
        "lm_head": 2 * tokens * c * VOCAB,
        "total": LAYERS * block + 2 * tokens * c * VOCAB,
    }


@pytest.mark.parametrize("batch,seq", [(2, 16), (3, 40)])
def test_gpt2_forward_flops_equal_the_hand_count(batch, seq):
    from torch.utils.flop_counter import FlopCounterMode

    from zerotrain.profiling.flops_profiler import get_model_profile

    model, hand = _gpt2(), _hand_count(batch, seq)
    ids = torch.randint(0, VOCAB, (batch, seq))
    flops, macs, params = get_model_profile(model, args=[ids], print_profile=False, as_string=False)
    assert flops == hand["total"]  # (2, 16): 7,602,176
    assert macs * 2 == flops
    assert params == sum(p.numel() for p in model.parameters())  # the tied lm_head counted once
    model.train()
    with FlopCounterMode(display=False) as counter:  # torch's counter itself, with grad
        loss = model(ids, labels=ids).loss
    assert counter.get_total_flops() == hand["total"]
    with FlopCounterMode(display=False) as counter:  # backward: twice the forward (the 3x of MFU)
        loss.backward()
    assert counter.get_total_flops() == 2 * hand["total"]
    assert (
        get_model_profile(model, args=[ids], print_profile=False, as_string=True)[0]
        == f"{round(hand['total'] / 1e6, 2):g} M"
    )


def test_profiler_api_printout_and_output_file(tmp_path, capsys):
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    from zerotrain.profiling.flops_profiler import FlopsProfiler

    model, hand = _gpt2(), _hand_count(2, 16)
    ids = torch.randint(0, VOCAB, (2, 16))
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    model(ids)
    profiler.stop_profile()
    model(ids)  # not counted
    profiler.resume_profile()
    model(ids)  # counted on
    profiler.stop_profile()
    assert profiler.get_total_flops() == 2 * hand["total"] and profiler.forwards == 2
    assert profiler.get_total_params() == sum(p.numel() for p in model.parameters())
    assert profiler.module_flops["transformer.h.1"] == 2 * hand["block"]
    assert profiler.module_flops["transformer.h.0.mlp"] == 2 * hand["mlp"]
    rows = {name: flops for name, _, _, flops, _ in profiler.module_rows()}
    assert rows["transformer.h"] == 2 * LAYERS * hand["block"]  # a ModuleList: its children's sum
    text = profiler.print_model_profile(
        profile_step=3, module_depth=1, top_modules=2, detailed=True, output_file=str(tmp_path / "sub" / "flops.txt")
    )
    assert capsys.readouterr().out == ""  # written to the file, not printed
    assert (tmp_path / "sub" / "flops.txt").read_text() == text
    assert "Profile Summary at step 3:" in text
    assert re.search(rf"^fwd flops per GPU: +15\.2 M \({2 * hand['total']}\)$", text, re.M)
    assert re.findall(r"^depth (\d+):", text, re.M) == ["0", "1"]  # module_depth=1
    flops_tops = re.findall(r"^    flops       - (\{.*\})$", text, re.M)
    assert flops_tops[1] == "{'GPT2Model': '13.11 M', 'Linear': '2.1 M'}"  # top_modules=2
    assert "(c_fc): Conv1D(" in text and "Detailed Profile per GPU" in text
    profiler.end_profile()
    assert profiler.print_model_profile() is None and not profiler.started

    profiler.start_profile(ignore_list=[GPT2MLP])  # no row of its own; its flops stay in the block
    model(ids)
    profiler.stop_profile()
    assert "transformer.h.0.mlp" not in profiler.module_flops
    assert profiler.module_flops["transformer.h.0"] == hand["block"]
    text = profiler.print_model_profile(module_depth=-1, top_modules=1, detailed=False)
    assert text == capsys.readouterr().out and "Detailed Profile" not in text
    assert re.findall(r"^depth (\d+):", text, re.M) == ["0", "1", "2", "3", "4", "5"]  # ...h.0.attn.c_attn
    profiler.end_profile()


def _train(out: str):
    import contextlib
    import io
    import logging

    import torch.distributed as dist

    import zerotrain
    from zerotrain.profiling.flops_profiler import get_model_profile

    micro, gas, steps, profile_step = 2, 2, 6, 2
    logs: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())

    logging.getLogger("zerotrain").addHandler(Keep())
    section = {"enabled": True, "profile_step": profile_step, "module_depth": 1, "top_modules": 3, "peak_tflops": 0.002}
    data = global_batches(steps * gas, micro * 2)
    result = {}
    for name, output_file in (("file", f"{out}/flops/profile.txt"), ("stdout", None)):
        cfg = adamw_config(
            micro,
            gas,
            steps_per_print=1,
            wall_clock_breakdown=True,
            zero_optimization={"stage": 3},
            flops_profiler={**section, "output_file": output_file},
        )
        engine, _, _, _ = zerotrain.initialize(model=make_model(), config=cfg)
        rank = dist.get_rank()
        printed, file_after = [], []
        for step in range(steps):
            with contextlib.redirect_stdout(io.StringIO()) as stdout:
                for m in range(gas):
                    batch = data[step * gas + m, rank * micro : (rank + 1) * micro]
                    engine.backward(engine(batch, labels=batch).loss)
                    engine.step()
            printed.append(stdout.getvalue())
            file_after.append(output_file is not None and __import__("os").path.exists(output_file))
        engine.destroy()
        result[name] = {"printed": printed, "file_after": file_after, "logs": list(logs)}
        logs.clear()
    batch = data[profile_step * gas + gas - 1, 0:micro]  # a micro-batch's shape: the same count
    result["one_forward"] = get_model_profile(
        make_model(), args=[batch], kwargs={"labels": batch}, print_profile=False, as_string=False
    )[0]
    result["params"] = sum(p.numel() for p in make_model().parameters())
    return result


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("flops")
    return out, run_on_ranks(_train, 2, args=(str(out),))


def test_engine_profiles_the_profile_step_only(engine_runs):
    out, (rank0, rank1) = engine_runs
    # stdout: the printout at the third step (global_steps == 2) of rank 0 only
    assert ["fwd flops per GPU:" in p for p in rank0["stdout"]["printed"]] == [False, False, True, False, False, False]
    quiet = rank1["stdout"]["printed"] + rank1["file"]["printed"] + rank0["file"]["printed"]
    assert not any("Flops Profiler" in p for p in quiet)  # rank 1 never; with output_file not printed
    text = rank0["stdout"]["printed"][2]
    flops = 2 * rank0["one_forward"]  # both micro-batches of the step, no backward
    assert re.search(rf"^fwd flops per GPU: +\S+ M \({flops}\)$", text, re.M)
    assert re.search(r"^forward calls profiled: +2$", text, re.M)
    assert re.search(rf"^params per GPU: +{round(rank0['params'] / 1e3, 2):g} K$", text, re.M)  # ZeRO-3: whole
    assert re.search(r"^world size: +2$", text, re.M) and re.search(r"^peak FLOPS per GPU: +2 GFLOPS$", text, re.M)
    assert re.search(r"^MFU = FLOPS per GPU / peak FLOPS per GPU: +\d+\.\d+%$", text, re.M)
    # output_file: written by rank 0 at the profile step, with the same figures
    assert rank0["file"]["file_after"] == [False, False, True, True, True, True]
    written = (out / "flops" / "profile.txt").read_text()
    assert re.search(rf"^fwd flops per GPU: +\S+ M \({flops}\)$", written, re.M)


def test_step_log_reports_tflops_and_mfu_after_the_profile(engine_runs):
    _, (rank0, rank1) = engine_runs
    lines = [line for line in rank0["stdout"]["logs"] if line.startswith("step=")]
    assert len(lines) == 6 and not [line for line in rank1["stdout"]["logs"] if line.startswith("step=")]
    # steps 1-3 (the third is the profiled, slowed one) have no figure; from step 4 on they do
    assert ["TFLOPS=" in line for line in lines] == [False, False, False, True, True, True]
    for line in lines[3:]:
        tflops, mfu = map(float, re.search(r"TFLOPS=([\d.e+-]+), MFU=([\d.]+)%", line).groups())
        assert mfu == pytest.approx(100 * tflops / 0.002, rel=1e-3, abs=0.006)  # as rounded in the line


def test_the_pipeline_engine_refuses_the_section():
    from zerotrain.config import load_config
    from zerotrain.engine.pipeline_engine import check_pipeline_config

    cfg = load_config({"train_batch_size": 2, "flops_profiler": {"enabled": True}}, world_size=1)
    with pytest.raises(NotImplementedError, match=r"^flops_profiler.enabled=true with a PipelineModule"):
        check_pipeline_config(cfg)
