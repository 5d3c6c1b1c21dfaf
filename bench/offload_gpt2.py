"""Flagship offload benchmark (issue 17): GPT-2-style models trained with optimizer state,
parameters and gradients on NVMe, one rank, bf16.

    python bench/offload_gpt2.py --nvme-path /work/offload_swap [--models 0.77b,1.5b,2.5b]
                                 [--steps 10] [--json out.json] [--in-memory]

Each model runs in its own process (``RANK=0 WORLD_SIZE=1``, ``OMP_NUM_THREADS`` = the cores):
``transformers.GPT2LMHeadModel`` built in bf16 from a config (random init, no download),
micro-batch 1 x 128 tokens, AdamW (lr 1e-4), ZeRO stage 3 with ``offload_optimizer`` and
``offload_param`` on NVMe (``sub_group_size`` 2^24, 4 optimizer buffers; 4 parameter buffers,
``buffer_size`` 2e8 elements since the 2.5B embedding's shard is 1.03e8 (buffers are sized to
the largest shard they carry), ``max_in_cpu`` 1e8 elements unless ``--max-in-cpu`` says
otherwise). ``--in-memory`` runs the same model without offload (for the "within 1.5x of
in-memory" comparison; only where it fits).

Reported per model: peak RSS (VmHWM), RSS before initialize (the model as built), median
seconds per step (steps 2..N), bytes read and written per step (optimizer chunks, parameter
shards, gradient shards), the share of the step spent waiting on swap I/O, the disk's busy
time per step (wall time with any swap read or write under way) against bytes moved over the
disk's bandwidth, and the swap footprint on disk. The disk's sequential O_DIRECT bandwidth each
way is measured first, in the same run, on a 4 GiB file under --nvme-path (``--disk-gib 0``
skips it). Seconds depend on what else the machine runs: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

MODELS = {  # GPT2Config fields: ~params
    "0.77b": dict(n_layer=36, n_embd=1280, n_head=20),  # GPT-2 large, 774M
    "1.5b": dict(n_layer=48, n_embd=1600, n_head=25),  # GPT-2 XL, 1.56B
    "2.5b": dict(n_layer=48, n_embd=2048, n_head=16),  # 2.52B
}
SEQ = 128
GIB = 2**30


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def disk_bandwidth(folder: str, gib: int, block: int = 8 << 20) -> dict:
    """Sequential write then read of a ``gib`` GiB file with O_DIRECT (buffered where the file
    system refuses it), ``block`` bytes per call: bytes per second each way."""
    import mmap

    path = os.path.join(folder, "zerotrain-bench-bandwidth")
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    total = gib * GIB
    flags = getattr(os, "O_DIRECT", 0)
    out = {}
    try:
        for way in ("write", "read"):
            try:
                fd = os.open(
                    path, (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if way == "write" else os.O_RDONLY) | flags, 0o600
                )
            except OSError:
                flags = 0
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC if way == "write" else os.O_RDONLY, 0o600)
            t0 = time.perf_counter()
            for offset in range(0, total, block):
                (os.pwritev if way == "write" else os.preadv)(fd, [buf], offset)
            if way == "write":
                os.fsync(fd)
            out[way] = total / (time.perf_counter() - t0)
            os.close(fd)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    out["direct"] = bool(flags)
    return out


def worker(model_key: str, steps: int, nvme: str, in_memory: bool, max_in_cpu: float) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import zerotrain

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=50257, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **MODELS[model_key]
    )
    torch.set_default_dtype(torch.bfloat16)  # built in the training dtype: no fp32 copy
    t0 = time.perf_counter()
    model = GPT2LMHeadModel(config)
    torch.set_default_dtype(torch.float32)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    rss_model = _status_kib("VmRSS") * 1024
    zero = {"stage": 3, "sub_group_size": 2**24, "stage3_param_persistence_threshold": 0}
    if not in_memory:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 4}
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme,
            "buffer_count": 4,
            "buffer_size": 2 * 10**8,
            "max_in_cpu": max_in_cpu,
        }
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    t0 = time.perf_counter()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    records = []
    for step in range(steps):
        ids = torch.randint(0, config.vocab_size, (1, SEQ), generator=g)
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - t0
        record = {"step": step + 1, "s": seconds, "loss": float(loss), "rss": _status_kib("VmRSS") * 1024}
        if not in_memory:
            stats = engine._zero.statistics(engine.module, engine.optimizer).offload
            parts = [stats, stats["params"], stats["grads"]]
            record.update(
                read=sum(p["bytes_read"] for p in parts),
                written=sum(p["bytes_written"] for p in parts),
                io_wait_s=sum(p["io_wait_s"] for p in parts),
                io_busy_s=stats["io_busy_s"],
                disk=stats["swap_file_bytes"] + stats["params"]["swap_file_bytes"],
                direct_io=stats["direct_io"],
            )
        records.append(record)
        print(json.dumps(record), flush=True)
    later = records[1:] or records
    out = {
        "model": model_key,
        "params": params,
        "offload": not in_memory,
        "steps": steps,
        "build_s": build_s,
        "init_s": init_s,
        "rss_model_bytes": rss_model,
        "peak_rss_bytes": _status_kib("VmHWM") * 1024,
        "s_per_step": statistics.median(r["s"] for r in later),
        "losses": [r["loss"] for r in records],
    }
    if not in_memory:
        out.update(
            read_per_step=statistics.median(r["read"] for r in later),
            written_per_step=statistics.median(r["written"] for r in later),
            io_wait_share=statistics.median(r["io_wait_s"] / r["s"] for r in later),
            io_busy_per_step=statistics.median(r["io_busy_s"] for r in later),
            disk_bytes=max(r["disk"] for r in records),
            direct_io=records[-1]["direct_io"],
        )
    engine.destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="0.77b,1.5b,2.5b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nvme-path", default="/work/offload_swap")
    parser.add_argument("--in-memory", action="store_true")
    parser.add_argument("--disk-gib", type=int, default=4)
    parser.add_argument(
        "--max-in-cpu",
        type=float,
        default=1e8,
        help="offload_param.max_in_cpu (elements of parameter and gradient shards "
        "kept in memory; DeepSpeed's default is 1e9)",
    )
    parser.add_argument("--json")
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        result = worker(args.worker, args.steps, args.nvme_path, args.in_memory, args.max_in_cpu)
        print("RESULT " + json.dumps(result), flush=True)
        return
    os.makedirs(args.nvme_path, exist_ok=True)
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29911",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)),
    }
    results = []
    disk = None
    if args.disk_gib and not args.in_memory:
        disk = disk_bandwidth(args.nvme_path, args.disk_gib)
        results.append({"disk_bandwidth": disk})
        print(
            f"disk: write {disk['write'] / 1e9:.2f} GB/s, read {disk['read'] / 1e9:.2f} GB/s "
            f"({'O_DIRECT' if disk['direct'] else 'buffered'}, {args.disk_gib} GiB)",
            flush=True,
        )
    for key in args.models.split(","):
        command = [
            sys.executable,
            __file__,
            "--worker",
            key,
            "--steps",
            str(args.steps),
            "--nvme-path",
            args.nvme_path,
            "--max-in-cpu",
            str(args.max_in_cpu),
        ] + (["--in-memory"] if args.in_memory else [])
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        line = next((out for out in run.stdout.splitlines() if out.startswith("RESULT ")), None)
        if run.returncode != 0 or line is None:
            print(f"{key}: failed (exit {run.returncode})\n{run.stderr[-3000:]}", file=sys.stderr)
            results.append({"model": key, "failed": run.returncode, "stderr": run.stderr[-3000:]})
            continue
        result = json.loads(line[len("RESULT ") :])
        results.append(result)
        line = (
            f"{key}: {result['params'] / 1e9:.2f}B params, peak RSS {result['peak_rss_bytes'] / GIB:.2f} GiB "
            f"(model as built {result['rss_model_bytes'] / GIB:.2f}), {result['s_per_step']:.1f} s/step"
        )
        if result["offload"]:
            line += (
                f", read {result['read_per_step'] / 1e9:.1f} GB + written "
                f"{result['written_per_step'] / 1e9:.1f} GB per step, I/O wait "
                f"{100 * result['io_wait_share']:.0f}%, disk busy {result['io_busy_per_step']:.1f} s/step, "
                f"on disk {result['disk_bytes'] / 1e9:.1f} GB"
            )
            if disk:
                floor = result["read_per_step"] / disk["read"] + result["written_per_step"] / disk["write"]
                result["io_floor_s"] = floor
                line += f"; bytes / bandwidth {floor:.1f} s (busy {result['io_busy_per_step'] / floor:.2f}x)"
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    leftovers = [d for d in os.listdir(args.nvme_path) if d.startswith("zerotrain-")]
    for d in leftovers:  # a crashed worker's swap folders
        shutil.rmtree(os.path.join(args.nvme_path, d), ignore_errors=True)


if __name__ == "__main__":
    main()
