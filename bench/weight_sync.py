"""What an RL loop pays to read a ZeRO-3 model's whole weights, three ways side by side, one run.

    python bench/weight_sync.py [--model 110m|17m] [--repeats 5]

2 gloo ranks (OMP_NUM_THREADS=1), transformers' GPT-2 (110m: 12 layers, width 768, vocab 32768;
17m: 4 layers, width 512, vocab 8192) at ZeRO-3 in fp32 with DeepSpeed's default persistence
threshold. Each pattern reads every parameter whole and copies it out (what a weight sync to an
inference server does with it), timed on rank 0, median of --repeats:

- `whole`: `GatheredParameters(model.parameters())` (TRL's generation gather): every unit in flight
  at once, then waited for;
- `whole_serial`: the same units gathered one after another, each waited for before the next
  starts (what `GatheredParameters` did before it put them all in flight);
- `per_param`: `GatheredParameters([p])` for each parameter in turn (OpenRLHF's vLLM sync loop): a
  unit is gathered once for each parameter it holds;
- `stream`: `zerotrain.zero.named_full_parameters(engine)`: each unit once, the next in flight.

Peak gathered elements per pattern come from the coordinator's count. The machine is shared:
compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

MODELS = {
    "110m": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=32768, n_positions=256),
    "17m": dict(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=256),
}


def _rank(model_name: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import zerotrain

    zerotrain.init_distributed()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODELS[model_name]))
    engine, *_ = zerotrain.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3},
        },
    )
    coordinator = engine.zero_stage_object.parameter_coordinator
    params = list(engine.module.named_parameters())

    def whole():
        with zerotrain.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}

    def whole_serial():  # the same, each unit gathered and waited for before the next starts
        units = coordinator.units
        for unit in units:
            coordinator.fetch(unit)
        try:
            return {n: p.detach().clone() for n, p in params}
        finally:
            for unit in units:
                coordinator.release(unit)

    def per_param():
        out = {}
        for n, p in params:
            with zerotrain.zero.GatheredParameters([p]):
                out[n] = p.detach().clone()
        return out

    def stream():
        return {n: t.clone() for n, t in zerotrain.zero.named_full_parameters(engine)}

    results = {}
    reference = None
    for name, fn in (("whole", whole), ("whole_serial", whole_serial), ("per_param", per_param), ("stream", stream)):
        times = []
        for _ in range(repeats):
            dist.barrier()
            coordinator.peak_live_numel = coordinator.live_numel
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
        reference = reference or out
        same = all(torch.equal(out[n], reference[n]) for n in reference)
        results[name] = {
            "median_s": statistics.median(times),
            "peak_gathered_elements": coordinator.peak_live_numel,
            "same_as_whole": same,
        }
    results["elements"] = sum(t.numel() for t in reference.values())
    engine.destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="110m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from zerotrain.testing import run_on_ranks

    result = run_on_ranks(_rank, world_size=2, args=(args.model, args.repeats), timeout=1800)[0]
    base = result["whole"]["median_s"]
    print(
        f"GPT-2 {args.model} ({result['elements'] / 1e6:.1f}M elements), ZeRO-3 fp32, 2 gloo ranks, "
        f"median of {args.repeats}"
    )
    print(f"{'pattern':<10} {'seconds':>9} {'vs whole':>9} {'peak gathered':>14} same")
    for name in ("whole", "whole_serial", "per_param", "stream"):
        row = result[name]
        print(
            f"{name:<10} {row['median_s']:>9.3f} {row['median_s'] / base:>8.2f}x "
            f"{row['peak_gathered_elements'] / 1e6:>13.1f}M {row['same_as_whole']}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
