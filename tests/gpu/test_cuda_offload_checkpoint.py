"""Offload, checkpoints and activation checkpointing on a CUDA device.

CI has no GPU: these skip there (``pytest -m gpu`` where one is at hand). One process on one
device with NCCL. On the CPU the offload and checkpoint tests compare bit for bit; here an
offloaded step runs on the host and an in-memory one on the device (other kernels), so
trajectories are compared within rounding, and the placement is checked: offloaded optimizer
state on the host, the host tensor each step copies to the device (the fp32 master, or the
shard under ``offload_param``) page-locked, everything else on the device.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoint.workloads import config as checkpoint_config
from tests.checkpoint.workloads import train
from tests.engine.workloads import make_model, train_steps
from tests.offload import test_offload
from zerotrain.testing import run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _state_tensors(opt):
    return [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]


def _crossing_host_tensors(engine) -> list[torch.Tensor]:
    """Per trained unit, the host tensor whose values go to the device: its shard where the
    shard lives on the host (offload_param), else its fp32 master where that does."""
    out = []
    for u in engine._zero.units:
        if not u.trained:
            continue
        if u.shard is not None and u.shard.device.type == "cpu":
            out.append(u.shard)
        elif u.master is not None and u.master.device.type == "cpu":
            out.append(u.master)
    return out


def _offload_runs(nvme_path: str) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for name, (stage, device, bf16, sgd) in test_offload.CASES.items():
        model = make_model()
        cfg = test_offload._config(stage, device, nvme_path, bf16, sgd)
        engine, opt, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = train_steps(engine, test_offload.STEPS)
        state = _state_tensors(opt)
        out[name] = {
            "losses": losses,
            "state_devices": {t.device.type for t in state},
            "crossing_pinned": [t.is_pinned() for t in _crossing_host_tensors(engine)],
            "module_devices": {p.device.type for p in engine.module.parameters()},
            "params": {n: v.float().cpu() for n, v in engine.module_state_dict().items()},
        }
        engine.destroy()
        out[name]["swap_left"] = [f for _, _, files in os.walk(nvme_path) for f in files]
    return out


def test_offload_matches_the_in_memory_trajectory_on_device(tmp_path):
    (runs,) = run_on_ranks(_offload_runs, world_size=1, args=(str(tmp_path),), timeout=900)
    failures = []
    for reference, offloaded in test_offload.PAIRS:
        want, got = runs[reference], runs[offloaded]
        tol = 1e-2 if "bf" in reference else 1e-4
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
            if abs(a - b) > tol * abs(b):
                failures.append(f"{offloaded}: step {step} loss {a} vs in-memory {b}")
        # bf16: the host step and the device step round a few weights apart by one bf16 ulp,
        # which is percents of a near-zero bias: compare the whole model there.
        names = sorted(want["params"])
        pairs = (
            [(n, got["params"][n], want["params"][n]) for n in names]
            if "bf" not in reference
            else [
                (
                    "whole model",
                    torch.cat([got["params"][n].flatten() for n in names]),
                    torch.cat([want["params"][n].flatten() for n in names]),
                )
            ]
        )
        for n, a, b in pairs:
            if _rel(a, b) > tol:
                failures.append(f"{offloaded}: {n} off by {_rel(a, b):.2e}")
    for name, r in runs.items():
        if r["module_devices"] != {"cuda"}:
            failures.append(f"{name}: module parameters on {r['module_devices']}")
        if name.endswith("cpu"):  # optimizer state on the host; what crosses the bus page-locked
            if r["state_devices"] != {"cpu"} or not r["crossing_pinned"] or not all(r["crossing_pinned"]):
                failures.append(
                    f"{name}: state on {r['state_devices']}, host tensors copied to "
                    f"the device pinned: {r['crossing_pinned']}"
                )
        elif not name.endswith("nvme") and r["state_devices"] != {"cuda"}:
            failures.append(f"{name}: in-memory optimizer state on {r['state_devices']}")
        if r["swap_left"]:
            failures.append(f"{name}: swap files left after destroy: {r['swap_left'][:3]}")
    assert not failures, "\n".join(failures)


def _checkpoint_runs(folder: str) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16", "fp16"):
            cfg = checkpoint_config(stage, precision)

            def build():
                model = make_model()
                return zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

            tag, engine = f"s{stage}{precision}", build()
            train(engine, 3)
            engine.save_checkpoint(folder, tag)
            reference = train(engine, 3)
            want = {n: v.float().cpu() for n, v in engine.module_state_dict().items()}
            want_scale = engine.loss_scale
            engine.destroy()
            engine = build()
            engine.load_checkpoint(folder, tag)
            resumed = train(engine, 3)
            got = {n: v.float().cpu() for n, v in engine.module_state_dict().items()}
            out[tag] = {
                "reference": reference,
                "resumed": resumed,
                "error": max(_rel(got[n], v) for n, v in want.items()),
                "scales": (want_scale, engine.loss_scale),
                "devices": {p.device.type for p in engine.module.parameters()},
            }
            engine.destroy()
    return out


def test_checkpoints_resume_on_device(tmp_path):
    (runs,) = run_on_ranks(_checkpoint_runs, world_size=1, args=(str(tmp_path),), timeout=900)
    failures = []
    for tag, r in runs.items():
        for step, (a, b) in enumerate(zip(r["resumed"], r["reference"])):
            if abs(a - b) > 1e-4 * abs(b):
                failures.append(f"{tag}: step {step} loss {a} after resuming vs {b}")
        if r["error"] > 1e-4:
            failures.append(f"{tag}: weights off by {r['error']:.2e} after resuming")
        if r["scales"][0] != r["scales"][1]:
            failures.append(f"{tag}: loss scale {r['scales'][1]} after resuming vs {r['scales'][0]}")
        if r["devices"] != {"cuda"}:
            failures.append(f"{tag}: parameters on {r['devices']} after loading")
    assert not failures, "\n".join(failures)


class _Block(torch.nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))


@pytest.mark.parametrize("in_cpu", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_replays_cuda_dropout(in_cpu, reentrant):
    """Recomputation replays the device RNG (the same dropout masks), so gradients equal the
    uncheckpointed ones; with ``checkpoint_in_cpu`` the saved inputs go to the host and back."""
    import zerotrain.checkpointing as ckpt
    from zerotrain.recompute import settings

    settings._unconfigure_for_tests()
    ckpt.reset_profile_totals()
    try:
        ckpt.configure(checkpoint_in_cpu=in_cpu)
        torch.manual_seed(0)
        blocks = [_Block().cuda() for _ in range(3)]
        x0 = torch.randn(8, 32, 64, device="cuda")
        function = ckpt.checkpoint if reentrant else ckpt.non_reentrant_checkpoint

        def grads(wrap):
            x = x0.clone().requires_grad_(True)
            h = x
            for block in blocks:
                h = wrap(block, h)
            h.square().mean().backward()
            out = [p.grad.clone() for b in blocks for p in b.parameters()] + [x.grad.clone()]
            for b in blocks:
                b.zero_grad(set_to_none=True)
            return out

        state = torch.cuda.get_rng_state()
        expected = grads(lambda b, h: b(h))
        torch.cuda.set_rng_state(state)
        got = grads(lambda b, h: function(b, h))
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
        totals = ckpt.profile_totals()
        assert totals["recompute_calls"] >= 3
        assert (totals["inputs_to_host_bytes"] > 0) == in_cpu
    finally:
        settings._unconfigure_for_tests()
