"""The reference GPT-2 workloads: torch DDP vs zerotrain ZeRO 0-3 vs FSDP2 (vs DeepSpeed), one run.

    python bench/gpt2_110m.py [--model 110m|17m|host] [--systems ddp,zt1,zt2,zt3,zt3_bf16,fsdp2]
                              [--steps 6] [--repeats 1] [--json out.json]
                              [--deepspeed-python /path/to/venv/bin/python]   # adds ds0..ds3
                              [--device cuda --nproc 1]   # on GPUs, NCCL

`--model 110m` (default): `transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12,
vocab_size=32768, n_positions=256, dropouts 0)`, micro-batch 2 x seq 128 per rank;
`--model 17m`: n_layer 4, n_embd 512, n_head 8, vocab 8192, n_positions 256, micro-batch 4 x 128;
`--model host` (host-bound): n_layer 24, n_embd 64, n_head 2, vocab 512, micro-batch 4 x 128.
Random init (torch.manual_seed(0)), 2 gloo ranks, OMP_NUM_THREADS=1, the config's optimizer
`{"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": true}}`,
gradient_clipping 0.0, DeepSpeed's defaults for everything else; fp32 (and bf16 at stage 3).
Each system is its own process pair — DDP and FSDP2 (`fully_shard` per block, then the root)
under `torchrun`, zerotrain under `zerotrain launch` (which preloads tcmalloc into CPU ranks when
it is installed: `SYSTEM:ZEROTRAIN_ALLOCATOR=system` keeps glibc; `ddp:LD_PRELOAD=...` gives DDP
tcmalloc; each row names the allocator its ranks ran on), DeepSpeed under torchrun with the
interpreter given by --deepspeed-python (a venv with deepspeed; the ds* systems are skipped
without it) — run one after another, alternating across repeats. zerotrain and DeepSpeed stage 3
build the model under their `zero.Init`. Every system then initialises the weights the same way (`init_weights`),
so all start from identical weights and their losses can be compared step by step.

Per rank: peak RSS (VmHWM of /proc/self/status — `ru_maxrss` would include the launcher's
pre-exec peak), RSS after each step (VmRSS), median step time (steps 2..N), the losses (step 1
compared with DDP's), and zerotrain's `engine.memory_breakdown()` live bytes, so the gap
peak RSS - live bytes is reported. The machine is shared: compare ratios, not seconds.

`--device cuda` runs every system on GPUs (one per rank, `--nproc` ranks, NCCL): the model and
batches on the device, each phase timed after `torch.cuda.synchronize()`, and the peak of
`torch.cuda.max_memory_allocated()` reported beside RSS.

Per-system settings (`SYSTEM:VAR=VALUE`): any environment variable, e.g.
`zt3:ZEROTRAIN_MEMORY_RELEASE=off`; `BENCH_LEAF_CLASSES=GPT2Block` gives zerotrain's config
`"leaf_module": {"classes": ["GPT2Block"]}` (empty: `{}`, per-module units);
`BENCH_CPROFILE=FILE` writes rank 0's host time by function over steps 2.. to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpt2_110m_report import report

MIB = 2**20
SYSTEMS = {  # key: (label, mode, stage, dtype)
    "ddp": ("torch DDP", "ddp", 0, "fp32"),
    "zt0": ("zerotrain stage 0", "zerotrain", 0, "fp32"),
    "zt1": ("zerotrain stage 1", "zerotrain", 1, "fp32"),
    "zt2": ("zerotrain stage 2", "zerotrain", 2, "fp32"),
    "zt3": ("zerotrain stage 3 (zero.Init)", "zerotrain", 3, "fp32"),
    "zt3_bf16": ("zerotrain stage 3 bf16 (zero.Init)", "zerotrain", 3, "bf16"),
    "fsdp2": ("torch FSDP2 (fully_shard)", "fsdp2", 3, "fp32"),
    "ds0": ("DeepSpeed stage 0", "deepspeed", 0, "fp32"),
    "ds1": ("DeepSpeed stage 1", "deepspeed", 1, "fp32"),
    "ds2": ("DeepSpeed stage 2", "deepspeed", 2, "fp32"),
    "ds3": ("DeepSpeed stage 3 (zero.Init)", "deepspeed", 3, "fp32"),
}
MODELS = {  # GPT2Config fields, micro-batch
    "110m": (dict(n_layer=12, n_embd=768, n_head=12, vocab_size=32768, n_positions=256), 2),
    "17m": (dict(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=256), 4),
    # issue 33's host-bound model: 24 small blocks, where per-unit host cost dominates the step.
    "host": (dict(n_layer=24, n_embd=64, n_head=2, vocab_size=512, n_positions=256), 4),
}


def proc_status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- one rank ------------------------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401  (imported now, not mid-build)

    from rss_sampler import malloc_in_use_mib

    rss_at = {"imports": proc_status_mib("VmRSS")}
    in_use_at = {"imports": malloc_in_use_mib()}
    cfg = transformers.GPT2Config(**MODELS[args.model][0], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    mode, stage, dtype = args.mode, args.stage, args.dtype
    torch.manual_seed(0)
    ds = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage, **json.loads(args.zero)},
    }
    leaf_classes = os.environ.get("BENCH_LEAF_CLASSES")  # zt3:BENCH_LEAF_CLASSES= : per-module units
    if leaf_classes is not None and mode == "zerotrain":
        ds["zero_optimization"]["leaf_module"] = {"classes": [c for c in leaf_classes.split(",") if c]}
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    cuda = args.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if mode in ("ddp", "fsdp2"):
        dist.init_process_group(backend)
        model = transformers.GPT2LMHeadModel(cfg)
    elif mode == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(backend)
        if stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=ds):
                model = transformers.GPT2LMHeadModel(cfg)
        else:
            model = transformers.GPT2LMHeadModel(cfg)
    else:
        import zerotrain
        from zerotrain.comm.distributed import init_distributed

        init_distributed()
        if stage == 3:
            with zerotrain.zero.Init():
                model = transformers.GPT2LMHeadModel(cfg)
        else:
            model = transformers.GPT2LMHeadModel(cfg)
    init_weights(
        model, cfg.n_layer, partitioned=mode in ("zerotrain", "deepspeed") and stage == 3, deepspeed=mode == "deepspeed"
    )
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rank = dist.get_rank()
    rss_at["model"] = proc_status_mib("VmRSS")
    params = sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters())
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if cuda:
            model.cuda()
        engine = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if cuda else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if cuda:
            model.cuda()
        for block in model.transformer.h:
            fully_shard(block)
        engine = fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    elif mode == "deepspeed":
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    else:
        engine, opt, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=ds)
    rss_at["initialized"] = proc_status_mib("VmRSS")

    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, cfg.vocab_size, (args.micro, args.seq), generator=gen) for _ in range(args.steps)]
    if cuda:
        batches = [b.cuda() for b in batches]
        sync()
    sampler = None
    if args.rss_sample_ms > 0:
        from rss_sampler import RssSampler

        sampler = RssSampler(args.rss_sample_ms / 1000, track_malloc=True)
        label_modules(model, sampler)
    mark = sampler.phase if sampler else (lambda label: None)
    losses, step_s, cpu_s, rss, live, phase_s, faults, phase_faults = [], [], [], [], [], [], [], []
    gc_s = _GcTimer()
    gc_per_step = []
    # BENCH_CPROFILE=FILE (as a system's setting, e.g. zt3:BENCH_CPROFILE=/tmp/p.txt): rank 0's
    # host time by function over steps 2.., the 40 largest by own time, written to FILE.
    profile_to = os.environ.get("BENCH_CPROFILE") if dist.get_rank() == 0 else None
    profiler, host_per_step = None, None
    for i, ids in enumerate(batches, 1):
        if profile_to and i == 2:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        dist.barrier()
        mark(f"{i} forward")
        t0, c0, u0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        if mode in ("ddp", "fsdp2"):
            loss = engine(ids, labels=ids).loss
            sync()
            mark(f"{i} backward")
            t1, f1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            loss.backward()
            sync()
            mark(f"{i} optimizer step")
            t2, f2 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            opt.step()
            opt.zero_grad(set_to_none=False)
        else:
            loss = engine(ids, labels=ids).loss
            sync()
            mark(f"{i} backward")
            t1, f1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            engine.backward(loss)
            sync()
            mark(f"{i} optimizer step")
            t2, f2 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            engine.step()
        sync()
        mark(f"{i} after step")
        step_s.append(time.perf_counter() - t0)
        cpu_s.append(time.process_time() - c0)
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        faults.append((u1.ru_minflt - u0.ru_minflt, u1.ru_stime - u0.ru_stime))
        phase_faults.append((f1 - u0.ru_minflt, f2 - f1, u1.ru_minflt - f2))
        gc_per_step.append(gc_s.take())
        phase_s.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        losses.append(float(loss))
        rss.append(proc_status_mib("VmRSS"))
        in_use_at[f"after step {i}"] = malloc_in_use_mib()
        if mode == "zerotrain":
            live.append(engine.memory_breakdown())
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        Path(profile_to).write_text(text.getvalue())
        from host_work import host_work

        host_per_step = host_work(pstats.Stats(profiler), len(batches) - 1)
    record = {
        "rank": rank,
        "params": params,
        "losses": losses,
        "step_s": step_s,
        "cpu_s": cpu_s,
        "faults": faults,
        "phase_faults": phase_faults,
        "gc_s": gc_per_step,
        "phase_s": phase_s,
        "rss_mib": rss,
        "rss_at_mib": rss_at,
        "peak_device_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "malloc_in_use_mib": in_use_at,
        "peak_rss_mib": proc_status_mib("VmHWM"),
        "memory_breakdown": live[-1] if live else None,
        "peak_live_bytes": max((_live_bytes(b) for b in live), default=None),
        "rss_peak_by_phase_mib": sampler.stop() if sampler else None,
        "malloc_in_use_at_phase_peak_mib": sampler.in_use_at_peak if sampler else None,
        "host_per_step": host_per_step,
        "allocator": _allocator_in_use(),
    }
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()


class _GcTimer:
    """Seconds the interpreter's cyclic garbage collector ran, per generation, since the last take()."""

    def __init__(self):
        import gc

        self._t0, self.spent = 0.0, [0.0, 0.0, 0.0]
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.spent[info["generation"]] += time.perf_counter() - self._t0

    def take(self) -> list[float]:
        out, self.spent = self.spent, [0.0, 0.0, 0.0]
        return out


def label_modules(model, sampler) -> None:
    """Name the phase after the module running: forward pre-hooks on the embeddings, each block
    and the head; in backward, a hook on each block's output fires when its gradient arrives."""
    named = [("wte", model.transformer.wte), ("wpe", model.transformer.wpe)]
    named += [(f"h.{i}", b) for i, b in enumerate(model.transformer.h)]
    named += [("ln_f", model.transformer.ln_f), ("lm_head", model.lm_head)]

    def pre(name):
        def hook(module, inputs):
            step = sampler.label.split()[0]
            sampler.phase(f"{step} forward {name}")

        return hook

    def post(name):
        def hook(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if out.requires_grad:
                out.register_hook(lambda g: sampler.phase(f"{sampler.label.split()[0]} backward {name}"))

        return hook

    for name, m in named:
        m.register_forward_pre_hook(pre(name))
        m.register_forward_hook(post(name))


def init_weights(model, n_layer: int, partitioned: bool, deepspeed: bool = False) -> None:
    """GPT-2's initialisation (HF's rules: normal(0, 0.02), residual projections scaled by
    1/sqrt(2 n_layer), LayerNorm 1/0, biases 0), drawn from one generator per parameter so every
    system starts from the same weights whatever order or placement built them (HF's own
    post_init cannot be replayed after zero.Init: its RNG draws happen in another order).
    Partitioned (stage 3): each module's parameters are gathered, written on rank 0, and
    scattered back by ``GatheredParameters``; at most one module is whole at a time."""
    import contextlib
    import math

    import torch
    import torch.distributed as dist

    if deepspeed:
        import deepspeed as ds  # deepspeed.zero is an attribute, not an importable module

        GatheredParameters = ds.zero.GatheredParameters
    else:
        from zerotrain.zero import GatheredParameters

    rank = dist.get_rank()
    seen = set()
    index = 0
    for mname, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        ctx = GatheredParameters([p for _, p in own], modifier_rank=0) if partitioned else contextlib.nullcontext()
        with ctx, torch.no_grad():
            for name, p in own:
                index += 1
                if partitioned and rank != 0:
                    continue
                gen = torch.Generator().manual_seed(index)
                if name == "bias" or isinstance(module, torch.nn.LayerNorm):
                    p.fill_(1.0 if name == "weight" else 0.0)
                else:
                    std = 0.02 / math.sqrt(2 * n_layer) if mname.endswith("c_proj") else 0.02
                    p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))


def _live_bytes(b: dict) -> int:
    """Bytes the engine holds at peak: persistent states + the peak of gathered parameters."""
    keys = ("parameters", "master_parameters", "gradients", "optimizer_state", "communication_buffers", "gather_pool")
    total = sum(int(b.get(k, 0)) for k in keys)
    return total + int(b.get("peak_gathered_parameters", 0))


def _allocator_in_use() -> str:
    """The C allocator this process runs on, from its memory maps (zerotrain launch preloads
    tcmalloc on CPU ranks by default: src/zerotrain/launcher/allocator.py)."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return next((name for name in ("tcmalloc", "jemalloc", "mimalloc") if f"lib{name}" in maps), "glibc")


# -- driver --------------------------------------------------------------------------------
def system(key: str) -> tuple[str, str, int, str, dict]:
    """A --systems entry: a SYSTEMS key, optionally followed by ``:VAR=VALUE`` environment
    settings for that system's processes (e.g. ``zt1:ZEROTRAIN_MALLOC_TUNING=0``). A value may
    hold colons itself (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.arena_max=2``): a
    piece that does not start with ``NAME=`` continues the previous value."""
    name, *pieces = key.split(":")
    label, mode, stage, dtype = SYSTEMS[name]
    settings: list[str] = []
    for piece in pieces:
        if settings and not re.match(r"[A-Z_][A-Z0-9_]*=", piece):
            settings[-1] += ":" + piece
        else:
            settings.append(piece)
    env = dict(s.split("=", 1) for s in settings)
    if env:
        label += " (" + " ".join(f"{k}={v}" for k, v in env.items()) + ")"
    return label, mode, stage, dtype, env


def launch(key: str, args, out: Path) -> list[dict]:
    label, mode, stage, dtype, extra_env = system(key)
    if mode in ("ddp", "fsdp2", "deepspeed"):
        python = args.deepspeed_python if mode == "deepspeed" else sys.executable
        cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    else:
        cmd = [sys.executable, "-m", "zerotrain.launcher.cli", "launch", "--nproc", str(args.nproc)]
    cmd += [
        __file__,
        "--worker",
        "--mode",
        mode,
        "--stage",
        str(stage),
        "--dtype",
        dtype,
        "--device",
        args.device,
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--micro",
        str(args.micro),
        "--seq",
        str(args.seq),
        "--rss-sample-ms",
        str(args.rss_sample_ms),
        "--zero",
        args.zero,
        "--out",
        str(out),
    ]
    cmd += ["--activation-checkpointing"] if args.activation_checkpointing else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{label} exited {proc.returncode}:\n" + "\n".join(proc.stderr.splitlines()[-20:]))
    recs = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["rank"])
    print(f"  {label}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return recs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="110m")
    ap.add_argument("--systems", default="ddp,zt1,zt2,zt3,zt3_bf16")
    ap.add_argument("--deepspeed-python", help="interpreter of a venv with deepspeed installed (for the ds* systems)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--micro", type=int, default=None, help="default: the model's")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="model.gradient_checkpointing_enable(use_reentrant=False)",
    )
    ap.add_argument("--json")
    ap.add_argument(
        "--zero",
        default="{}",
        help="extra zero_optimization keys for zerotrain, as JSON, e.g. '{\"stage3_prefetch_bucket_size\": 13000000}'",
    )
    ap.add_argument(
        "--rss-sample-ms",
        type=float,
        default=0.0,
        help="sample RSS every N ms and report the peak per phase (module running)",
    )
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, NCCL (default: CPU, gloo)"
    )
    ap.add_argument("--nproc", type=int, default=2, help="ranks per system (default 2)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--mode", default="ddp")
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--out")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=0)
    args = ap.parse_args(argv)
    if args.micro is None:
        args.micro = MODELS[args.model][1]
    if args.worker:
        return worker(args)
    keys = args.systems.split(",")
    if not args.deepspeed_python:
        skipped = [k for k in keys if system(k)[1] == "deepspeed"]
        if skipped:
            print(f"skipping {','.join(skipped)}: no --deepspeed-python", file=sys.stderr)
        keys = [k for k in keys if k not in skipped]
    runs: dict[str, list[list[dict]]] = {k: [] for k in keys}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = keys if rep % 2 == 0 else keys[::-1]  # alternate the order across repeats
            for k in order:
                out = Path(tmp) / f"{keys.index(k)}_{rep}.jsonl"  # keys may hold paths
                try:
                    runs[k].append(launch(k, args, out))
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # report the others
                    print(f"  {system(k)[0]} FAILED: {e}", file=sys.stderr, flush=True)
    runs = {k: reps for k, reps in runs.items() if reps}
    if not runs:
        sys.exit("no system ran")
    report(runs, args, lambda key: system(key)[0])


if __name__ == "__main__":
    main()
