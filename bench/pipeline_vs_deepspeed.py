"""zerotrain's pipeline engine against DeepSpeed 0.19.8's, its extension schedules against 1F1B, and
pipelining against plain ZeRO data parallelism: one run, interleaved launches, same model and data.

    python bench/pipeline_vs_deepspeed.py [--rounds 3] [--steps 10] [--warmup 3] [--batch 16]
        [--micro-batches 4,8] [--schedules all|NAME,...] [--ext-micro-batches 4]
        [--ds-venv /tmp/dsvenv] [--json out.json] [--only zt_1f1b_m4,ds_m4]

Every case is one launch of 2 gloo processes (``torchrun --nproc_per_node 2``, ``OMP_NUM_THREADS=1``),
each from its own virtualenv: zerotrain's from the interpreter running this script, DeepSpeed's
from ``--ds-venv`` (``DS_ACCELERATOR=cpu``; zerotrain is not installed there, so this file imports
only torch at module level). A round launches every case once, in a fixed order (A B C ... A B C
...), so the machine's drift falls on every case alike; ratios are taken within a round.

- Part 1, zerotrain against DeepSpeed: the same ``PipelineModule`` layers (``LayerSpec``s of the
  BERT-like encoder of bench/pipeline_bubble.py), P=2, ``partition_method="type:Block"``, M in
  ``--micro-batches`` micro-batches of ``batch/M`` sequences per step, fp32, ZeRO stage
  ``--zero-stage`` (0), the ``"Adam"`` optimizer each library builds by default (DeepSpeed's FusedAdam
  CPU kernel; zerotrain's torch AdamW, fused where torch offers it), lr 1e-4, no clipping.
  zerotrain runs 1F1B (its default), DeepSpeed its only training schedule, ``TrainSchedule``.
- Part 2, zerotrain's schedules at M = ``--ext-micro-batches`` (M=2P=4): every name in
  ``--schedules`` (``all``: every schedule ``zerotrain.pipeline.schedule.SCHEDULES`` offers when the
  bench starts, so schedules added later are included); a schedule that needs several model chunks
  per rank gets ``PipelineModule(virtual_stages=2)``.
- Part 3, plain ZeRO-1 data parallelism over the same 2 processes: the same layers as an
  ``nn.Sequential`` through ``zerotrain.initialize``, the same global batch per step; ``dp_mM``:
  micro-batches of batch/M (the pipeline's), M/2 accumulation steps per rank; ``dp_gas1``: one
  micro-batch of batch/2 per rank.

Every layer seeds its own initialisation (``seed`` argument), so every case starts from the same
weights and trains on the same sequences: the losses printed beside the speeds say the cases did
the same work. Measured: after ``--warmup`` steps, a barrier, ``--steps`` ``train_batch`` calls (DP:
the accumulation steps and ``step``), a barrier; samples/s = steps x batch / that time (rank 0's
clock). Per case: min and median over rounds; ratios: per round, then min/median.

``--breakdown`` (on by default; ``--no-breakdown``): after the rounds, one more launch per pipeline
case that measures where each stage's time goes (not counted in the speeds): zerotrain with
``"pipeline": {"timeline": true}`` (per stage forward+backward busy, p2p comm, idle, and the rest
of ``train_batch``: gradient reduction, optimizer step, loss broadcast); DeepSpeed by timing its
pipeline instructions (``_INSTRUCTION_MAP``: forward, backward, send/recv, the rest).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


# -- the model (importable without zerotrain: DeepSpeed's venv runs this file too; --------------
# -- bench/pipeline_bubble.py builds its encoder's ends from Embed and Head too, without seeds) ----
def _seed(seed: int | None) -> None:
    if seed is not None:  # each layer's init from its own seed: same weights whoever builds it
        torch.manual_seed(seed)


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int, seed: int | None = None):
        _seed(seed)
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.norm(self.tokens(ids) + self.positions(pos))


class Block(nn.TransformerEncoderLayer):
    def __init__(self, hidden: int, heads: int, seed: int):
        torch.manual_seed(seed)
        super().__init__(hidden, heads, 4 * hidden, dropout=0.0, activation="gelu", batch_first=True)


class Head(nn.Module):
    def __init__(self, vocab: int, hidden: int, seed: int | None = None):
        _seed(seed)
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.norm(nn.functional.gelu(self.dense(x))))


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def layer_specs(spec_cls, a: dict) -> list:
    return (
        [spec_cls(Embed, a["vocab"], a["hidden"], a["seq"], 0)]
        + [spec_cls(Block, a["hidden"], a["heads"], 1 + i) for i in range(a["layers"])]
        + [spec_cls(Head, a["vocab"], a["hidden"], 1 + a["layers"])]
    )


def sequential(a: dict) -> nn.Sequential:
    return nn.Sequential(
        Embed(a["vocab"], a["hidden"], a["seq"], 0),
        *[Block(a["hidden"], a["heads"], 1 + i) for i in range(a["layers"])],
        Head(a["vocab"], a["hidden"], 1 + a["layers"]),
    )


def batches(a: dict, m: int) -> list:
    """Every step's m micro-batches (ids, labels): the same sequences for every case."""
    g = torch.Generator().manual_seed(1)
    micro = a["batch"] // m
    out = []
    for _ in range(a["warmup"] + a["steps"]):
        ids = torch.randint(0, a["vocab"], (a["batch"], a["seq"]), generator=g)
        out.append([(ids[i * micro : (i + 1) * micro], ids[i * micro : (i + 1) * micro]) for i in range(m)])
    return out


def train_config(a: dict, m: int, dp: int, zero_stage: int) -> dict:
    """DeepSpeed's config for M micro-batches per global batch over ``dp`` data-parallel ranks."""
    return {
        "train_batch_size": a["batch"],
        "train_micro_batch_size_per_gpu": a["batch"] // m,
        "gradient_accumulation_steps": m // dp,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": zero_stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
    }


# -- worker: one case on one rank (under torchrun) ------------------------------------------------------
class _Clock:
    """Seconds per category of DeepSpeed's pipeline instructions, per train_batch."""

    CATEGORY = {
        "ForwardPass": "forward",
        "BackwardPass": "backward",
        "SendActivation": "comm",
        "RecvActivation": "comm",
        "SendGrad": "comm",
        "RecvGrad": "comm",
    }

    def __init__(self):
        self.now = {}

    def wrap(self, engine_cls):
        table = engine_cls._INSTRUCTION_MAP
        for kind, fn in list(table.items()):
            table[kind] = self._timed(fn, self.CATEGORY.get(kind.__name__, "other"))

    def _timed(self, fn, category):
        def timed(engine, **kwargs):
            start = time.perf_counter()
            try:
                return fn(engine, **kwargs)
            finally:
                self.now[category] = self.now.get(category, 0.0) + time.perf_counter() - start

        return timed


def _run_steps(a, step_fn, barrier, on_step=None):
    times, losses = [], []
    for i in range(a["warmup"]):
        losses.append(float(step_fn(i)))
    barrier()
    start = time.perf_counter()
    for i in range(a["warmup"], a["warmup"] + a["steps"]):
        t0 = time.perf_counter()
        losses.append(float(step_fn(i)))
        times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(times[-1])
    barrier()
    return time.perf_counter() - start, times, losses


def _worker_deepspeed(a: dict, case: dict) -> dict:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    deepspeed.init_distributed(dist_backend="gloo")
    m = case["m"]
    clock = None
    if a.get("breakdown_run"):
        clock = _Clock()
        clock.wrap(PipelineEngine)
    net = PipelineModule(layers=layer_specs(LayerSpec, a), num_stages=2, loss_fn=loss_fn, partition_method="type:Block")
    engine, *_ = deepspeed.initialize(
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=train_config(a, m, 1, a["zero_stage"]),
    )
    data = batches(a, m)
    breakdown = []

    def step(i):
        if clock is not None:
            clock.now = {}
        return engine.train_batch(iter(data[i]))

    def record(total):
        if clock is not None:
            breakdown.append(dict(clock.now, total=total))

    block, times, losses = _run_steps(a, step, dist.barrier, record)
    return {"stage": engine.stage_id, "block": block, "times": times, "losses": losses, "breakdown": breakdown}


def _worker_zerotrain(a: dict, case: dict) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    if case["system"] == "zerotrain_dp":
        return _worker_dp(a, case)
    m = case["m"]
    config = {
        **train_config(a, m, 1, a["zero_stage"]),
        "pipeline": {"schedule": case["schedule"], "timeline": bool(a.get("breakdown_run"))},
    }
    from zerotrain.pipeline import LayerSpec, PipelineModule

    layout = {"virtual_layout": case["layout"]} if case.get("layout", "looped") != "looped" else {}
    net = PipelineModule(
        layer_specs(LayerSpec, a),
        num_stages=2,
        loss_fn=loss_fn,
        partition_method="type:Block",
        virtual_stages=case.get("virtual", 1),
        **layout,
    )
    engine, *_ = zerotrain.initialize(model=net, model_parameters=net.parameters(), config=config)
    data = batches(a, m)
    breakdown = []

    def record(total):
        if a.get("breakdown_run"):
            bubble = engine.pipeline_bubble()
            mine = bubble["stages"][engine.stage_id]
            breakdown.append(
                {
                    "busy": mine["busy"],
                    "comm": mine["comm"],
                    "idle": mine["idle"],
                    "schedule": bubble["duration"],
                    "total": total,
                }
            )

    group = engine.topology.group("pipe")
    block, times, losses = _run_steps(
        a, lambda i: engine.train_batch(iter(data[i])), lambda: torch.distributed.barrier(group=group), record
    )
    out = {"stage": engine.stage_id, "block": block, "times": times, "losses": losses, "breakdown": breakdown}
    engine.destroy()
    return out


def _worker_dp(a: dict, case: dict) -> dict:
    import zerotrain

    m = case["m"]  # micro-batches per global batch (over both ranks)
    net = sequential(a)
    engine, *_ = zerotrain.initialize(model=net, model_parameters=net.parameters(), config=train_config(a, m, 2, 1))
    rank, ranks = engine.topology.data_rank, engine.topology.data_size
    data = batches(a, m)
    mine = m // 2

    def step(i):
        total = torch.zeros(())
        for x, y in data[i][rank * mine : (rank + 1) * mine]:
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        total /= mine
        torch.distributed.all_reduce(total, group=engine.topology.data_group)
        return total / ranks

    group = engine.topology.data_group
    block, times, losses = _run_steps(a, step, lambda: torch.distributed.barrier(group=group))
    return {"stage": rank, "block": block, "times": times, "losses": losses, "breakdown": []}


def worker(a: dict, case: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    fn = _worker_deepspeed if case["system"] == "deepspeed" else _worker_zerotrain
    result = fn(a, case)
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()


# -- orchestration ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _placement(sched, name: str) -> tuple[int, str]:
    """The model chunks per rank and their placement the engine accepts for a schedule: one
    chunk, two looped (interleaved, zero-bubble) or two in a V (zbv, dualpipev)."""
    takes_layout = "layout" in inspect.signature(sched.check_schedule).parameters
    for virtual, layout in ((1, "looped"), (2, "looped"), (2, "v")):
        if layout != "looped" and not takes_layout:
            break
        try:
            sched.check_schedule(name, virtual, *([layout] if takes_layout else []))
            return virtual, layout
        except ValueError:
            continue
    raise SystemExit(
        f"--schedules: {name!r} takes none of 1 chunk per rank, 2 looped or 2 in a V; leave it out of --schedules"
    )


def _cases(args) -> list[dict]:
    from zerotrain.pipeline import schedule as sched

    cases = []
    for m in args.micro_batches:
        cases.append({"name": f"zt_1f1b_m{m}", "system": "zerotrain", "schedule": "1f1b", "m": m})
        cases.append({"name": f"ds_m{m}", "system": "deepspeed", "schedule": "TrainSchedule", "m": m})
    names = [s for s in sched.SCHEDULES if s != "1f1b"] if args.schedules == "all" else args.schedules.split(",")
    for name in names:
        if name not in sched.SCHEDULES:
            raise SystemExit(
                f"--schedules: {name!r} is not a schedule this zerotrain offers "
                f"({', '.join(sched.SCHEDULES)}); pick from those or 'all'"
            )
        virtual, layout = _placement(sched, name)
        for m in args.ext_micro_batches:
            if name == "1f1b" and m in args.micro_batches:
                continue
            cases.append(
                {
                    "name": f"zt_{name}_m{m}",
                    "system": "zerotrain",
                    "schedule": name,
                    "m": m,
                    "virtual": virtual,
                    "layout": layout,
                }
            )
    for m in args.ext_micro_batches:
        if f"zt_1f1b_m{m}" not in {c["name"] for c in cases}:
            cases.append({"name": f"zt_1f1b_m{m}", "system": "zerotrain", "schedule": "1f1b", "m": m})
    for m in args.micro_batches:
        cases.append({"name": f"dp_m{m}", "system": "zerotrain_dp", "schedule": "-", "m": m})
    cases.append({"name": "dp_gas1", "system": "zerotrain_dp", "schedule": "-", "m": 2})
    if args.only:
        keep = args.only.split(",")
        unknown = [k for k in keep if k not in {c["name"] for c in cases}]
        if unknown:
            raise SystemExit(f"--only: no case named {unknown}; cases: {[c['name'] for c in cases]}")
        cases = [c for c in cases if c["name"] in keep]
    return cases


def _launch(args, a: dict, case: dict, tmp: str) -> dict:
    out = os.path.join(tmp, f"{case['name']}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if case["system"] == "deepspeed":
        torchrun = os.path.join(args.ds_venv, "bin", "torchrun")
        env.update(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")
        env.pop("PYTHONPATH", None)
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [
        torchrun,
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(HERE),
        "--worker",
        json.dumps(a),
        json.dumps(case),
        out,
    ]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
    wall = time.perf_counter() - started
    if proc.returncode != 0 or not os.path.exists(out):
        errors = [
            line
            for line in (proc.stdout + proc.stderr).splitlines()
            if line.split(":")[0].endswith(("Error", "Exception")) and "ChildFailedError" not in line
        ]
        why = errors[-1] if errors else (proc.stdout + proc.stderr)[-2000:]
        print(f"case {case['name']} failed (exit {proc.returncode}); left out of the tables: {why}", flush=True)
        return None
    with open(out) as f:
        ranks = json.load(f)
    os.remove(out)
    block = ranks[0]["block"]
    per_step = [max(r["times"][i] for r in ranks) for i in range(a["steps"])]
    return {
        "case": case["name"],
        "samples_per_s": a["steps"] * a["batch"] / block,
        "s_per_step": block / a["steps"],
        "step_median": statistics.median(per_step),
        "losses": ranks[-1]["losses"],
        "load": load,
        "launch_s": wall,
        "ranks": ranks,
    }


def _fmt_row(cells, widths):
    return " ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def _summaries(cases, runs):
    table = {}
    for case in cases:
        sps = [r["samples_per_s"] for r in runs if r["case"] == case["name"]]
        if not sps:
            continue
        table[case["name"]] = {"median": statistics.median(sps), "max": max(sps), "min": min(sps), "n": len(sps)}
    return table


def _ratio(runs, a_name, b_name):
    """Per round samples/s of a over b; (min, median, max)."""
    by_round = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["case"]] = r["samples_per_s"]
    ratios = [v[a_name] / v[b_name] for v in by_round.values() if a_name in v and b_name in v]
    if not ratios:
        return None
    return min(ratios), statistics.median(ratios), max(ratios)


def _breakdown_text(case, result) -> list[str]:
    lines = []
    for r in sorted(result["ranks"], key=lambda r: r["stage"]):
        rows = r["breakdown"]
        if not rows:
            continue
        mean = {k: statistics.mean(row[k] for row in rows) * 1000 for k in rows[0] if k != "schedule"}
        if case["system"] == "deepspeed":
            busy = mean.get("forward", 0) + mean.get("backward", 0)
            comm = mean.get("comm", 0)
            rest = mean["total"] - busy - comm
            lines.append(
                f"  {case['name']:>22} stage {r['stage']}: train_batch {mean['total']:.0f} ms = "
                f"forward+backward {busy:.0f} + send/recv {comm:.0f} + rest {rest:.0f} "
                f"(load, reduce, optimizer, loss)"
            )
        else:
            sched_ms = statistics.mean(row["schedule"] for row in rows) * 1000
            lines.append(
                f"  {case['name']:>22} stage {r['stage']}: train_batch {mean['total']:.0f} ms = schedule "
                f"{sched_ms:.0f} (busy {mean['busy']:.0f} + comm {mean['comm']:.0f} + idle "
                f"{mean['idle']:.0f}) + rest {mean['total'] - sched_ms:.0f} (reduce, optimizer, loss, "
                f"timeline barriers)"
            )
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (global)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1))
    parser.add_argument("--micro-batches", default="4,8", help="M for zerotrain 1F1B vs DeepSpeed and for DP")
    parser.add_argument("--ext-micro-batches", default="4", help="M for the schedules comparison (2P)")
    parser.add_argument("--schedules", default="all", help="'all' (every schedule zerotrain offers) or names")
    parser.add_argument("--ds-venv", default="/tmp/dsvenv")
    parser.add_argument("--only", default="", help="run only these case names (comma-separated)")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    parser.add_argument("--launch-timeout", type=int, default=900)
    parser.add_argument("--json", default="", help="also write every run here")
    args = parser.parse_args(argv)
    args.micro_batches = [int(x) for x in args.micro_batches.split(",")]
    args.ext_micro_batches = [int(x) for x in args.ext_micro_batches.split(",")]
    for m in set(args.micro_batches + args.ext_micro_batches):
        if args.batch % m or m % 2:
            raise SystemExit(
                f"--batch {args.batch}: every M must be even (2 data-parallel ranks) and divide it; M={m} does not"
            )
    a = {
        k: getattr(args, k)
        for k in ("steps", "warmup", "batch", "seq", "hidden", "heads", "layers", "vocab", "zero_stage")
    }
    cases = _cases(args)
    if any(c["system"] == "deepspeed" for c in cases) and not os.path.exists(
        os.path.join(args.ds_venv, "bin", "torchrun")
    ):
        raise SystemExit(
            f"--ds-venv {args.ds_venv}: no bin/torchrun there; create it as docs/benchmarks.md says "
            "or leave DeepSpeed's cases out (--only)"
        )
    start_load = os.getloadavg()
    print(
        f"BERT-like encoder: {args.layers} x Block(hidden {args.hidden}, {args.heads} heads, ffn "
        f"{4 * args.hidden}), seq {args.seq}, vocab {args.vocab}; batch {args.batch} per step; P=2, 2 gloo "
        f"processes; {args.steps} measured steps after {args.warmup}; {args.rounds} rounds of "
        f"{len(cases)} cases; torch {torch.__version__}; {os.cpu_count()} cores"
    )
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in start_load)}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for case in cases:
                r = _launch(args, a, case, tmp)
                if r is None:
                    continue
                r["round"] = rnd
                runs.append(r)
                print(
                    f"round {rnd} {case['name']:>22}: {r['samples_per_s']:7.1f} samples/s "
                    f"({r['s_per_step']:.3f} s/step, launch {r['launch_s']:.0f} s, load {r['load']:.1f}, "
                    f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f})",
                    flush=True,
                )
        breakdowns = []
        if args.breakdown:
            for case in cases:
                if case["system"] == "zerotrain_dp":
                    continue
                result = _launch(args, dict(a, breakdown_run=True), case, tmp)
                if result is not None:
                    breakdowns.append((case, result))
    end_load = os.getloadavg()

    table = _summaries(cases, runs)
    print(f"\nsamples/s over {args.rounds} rounds (min / median / max); losses: first and last step of round 0")
    widths = (22, 16, 3, 7, 7, 7, 10, 10)
    print(_fmt_row(("case", "schedule", "M", "min", "median", "max", "loss[0]", "loss[-1]"), widths))
    for case in cases:
        if case["name"] not in table:
            print(_fmt_row((case["name"], case["schedule"], case["m"], "failed"), widths[:4]))
            continue
        t = table[case["name"]]
        first = next(r for r in runs if r["case"] == case["name"])
        print(
            _fmt_row(
                (
                    case["name"],
                    case["schedule"],
                    case["m"],
                    f"{t['min']:.1f}",
                    f"{t['median']:.1f}",
                    f"{t['max']:.1f}",
                    f"{first['losses'][0]:.6f}",
                    f"{first['losses'][-1]:.6f}",
                ),
                widths,
            )
        )

    print("\nratios of samples/s, per round (min / median / max)")
    names = {c["name"] for c in cases}
    pairs = [(f"zt_1f1b_m{m}", f"ds_m{m}") for m in args.micro_batches]
    for m in args.ext_micro_batches:
        pairs += [
            (c["name"], f"zt_1f1b_m{m}")
            for c in cases
            if c["system"] == "zerotrain" and c["m"] == m and c["schedule"] != "1f1b"
        ]
    pairs += [(f"zt_1f1b_m{m}", f"dp_m{m}") for m in args.micro_batches]
    pairs += [(f"zt_1f1b_m{m}", "dp_gas1") for m in args.micro_batches]
    ratios = {}
    for x, y in pairs:
        if x in names and y in names:
            r = _ratio(runs, x, y)
            ratios[f"{x}/{y}"] = r
            if r is None:
                continue
            print(f"  {x + ' / ' + y:>36}: {r[0]:.2f} / {r[1]:.2f} / {r[2]:.2f}")
    if breakdowns:
        print("\nwhere the time goes (one extra launch per case, means over its measured steps; not in the speeds)")
        for case, result in breakdowns:
            for line in _breakdown_text(case, result):
                print(line)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in end_load)}")
    out = {
        "args": vars(args),
        "start_load": start_load,
        "end_load": end_load,
        "cases": cases,
        "table": table,
        "ratios": ratios,
        "runs": runs,
        "breakdowns": [{"case": c["name"], "ranks": r["ranks"]} for c, r in breakdowns],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])
    else:
        main()
