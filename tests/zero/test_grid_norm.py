"""The gradient norm and the fp16 overflow decision over every rank holding distinct parameters,
and per-unit gradient divide factors (issue 30 item 3).

A 2 x 2 layout (data x model, ``PipelineParallelGrid`` over ``PipeModelDataParallelTopology``):
model rank m holds layer m of a two-layer model, and the loss is the sum of each layer's own
loss, so no activation crosses ranks. With clipping active, SGD at stages 0-3 must equal one
process training the whole model on the whole batch with the norm over all its parameters;
an fp16 overflow on one model rank must make every rank skip the step.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.testing import run_on_ranks

D = 6  # features in and out of each layer
MICRO = 3  # samples per data rank
DP = 2  # data-parallel ranks
STEPS = 3
LR = 0.1
CLIP = 0.05  # far below the gradient norm: clipping scales every step


def _full_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global inputs and targets, one per layer: ``[layer, sample, D]``."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2, MICRO * DP, D, generator=g), torch.randn(2, MICRO * DP, D, generator=g)


def _layer_loss(layer: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((layer(x) - y) ** 2).mean()


def _tie() -> nn.Parameter:
    torch.manual_seed(2)
    return nn.Parameter(torch.randn(D))


def _tie_loss(tie: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((x @ tie) ** 2).mean()  # a mean of per-sample losses, as the layers


def _reference(clip: float | None = CLIP, steps: int = STEPS, sum_layers: tuple = (), tie: bool = False):
    """One process, whole model and batch: the weights after ``steps`` SGD steps, and each step's
    norm. ``sum_layers``: layers whose gradient is the data ranks' sum (divide factor 1).
    ``tie``: a parameter ``tie`` both layers' losses use (counted once in the norm)."""
    model = _full_model()
    if tie:
        model.tie = _tie()
    norms = []
    for step in range(steps):
        x, y = _batches(step)
        loss = sum(_layer_loss(model[m], x[m], y[m]) for m in range(2))
        if tie:
            loss = loss + sum(_tie_loss(model.tie, x[m]) for m in range(2))
        model.zero_grad()
        loss.backward()
        for m in sum_layers:
            for p in model[m].parameters():
                p.grad.mul_(DP)
        grads = [p.grad for p in model.parameters()]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        norms.append(norm)
        coef = clip / (norm + 1e-6) if clip else 1.0
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * min(coef, 1.0) * p.grad
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


class _Half(nn.Module):
    """Model rank m's share of the full model: its layer, under the full model's name, and
    (``tie``) a copy of the tied parameter both halves use: model rank 1's copy is marked
    ``ds_pipe_replicated`` (model rank 0 counts it in the norm)."""

    def __init__(self, m: int, tie: bool):
        super().__init__()
        self.m = m
        self.layer = _full_model()[m]
        self.tie = _tie() if tie else None
        if tie and m == 1:
            self.tie.ds_pipe_replicated = True

    def forward(self, x, y):
        loss = _layer_loss(self.layer, x, y)
        return loss if self.tie is None else loss + _tie_loss(self.tie, x)


def _sum_over(group):
    """A gradient hook summing a tied parameter's gradient over ``group`` (its copies' ranks)."""
    import torch.distributed as dist

    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


def _config(stage: int, precision: str = "fp32", clip: float | None = CLIP) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    cfg["gradient_clipping"] = clip or 0.0  # off unless given (the default is 1.0)
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    return cfg


def _weights(engine, stage: int) -> dict:
    """This rank's whole weights (its layer) in fp32, by the full model's names."""
    from zerotrain.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params, enabled=stage == 3):
        return {
            (n if n == "tie" else f"{engine.module.m}.{n.split('.', 1)[1]}"): p.detach().float().clone()
            for n, p in engine.module.named_parameters()
        }


def _grid():
    from zerotrain.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    return PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=DP))


def _train_on_grid(grid, stage: int, precision: str = "fp32", overflow_step: int | None = None):
    """Train this rank's half on the grid; return its weights after each step, each step's
    reported norm, whether each step was applied, and the loss scale after each step."""
    import zerotrain

    tie = precision == "fp32"  # fp16: the tie's sum would carry one rank's overflow to the other
    half = _Half(grid.get_model_parallel_rank(), tie)
    engine, *_ = zerotrain.initialize(model=half, config=_config(stage, precision), mpu=grid)
    m, d = engine.topology.rank("model"), engine.topology.data_rank
    if tie:
        half.tie.register_hook(_sum_over(engine.topology.group("model")))
    dtype = torch.float16 if precision == "fp16" else torch.float32
    out = {"norms": [], "applied": [], "scales": [], "weights": []}
    for step in range(STEPS):
        x, y = _batches(step)
        x, y = x[m, d * MICRO : (d + 1) * MICRO].to(dtype), y[m, d * MICRO : (d + 1) * MICRO].to(dtype)
        if step == overflow_step and (m, d) == (1, 0):  # one model rank of one replica overflows
            x = x * 6e4
        engine.backward(engine(x, y))
        engine.step()
        out["norms"].append(engine.get_global_grad_norm())
        out["applied"].append(engine.was_step_applied())
        out["scales"].append(engine.loss_scale)
        out["weights"].append(_weights(engine, stage))
    out["coord"] = (m, d)
    import tempfile

    try:  # model ranks would write the same files: refused, naming the topology
        engine.save_checkpoint(tempfile.mkdtemp())
        out["save"] = "saved"
    except NotImplementedError as error:
        out["save"] = str(error)
    engine.destroy()
    return out


def _units_named(stage_object, prefix: str) -> list:
    return [u for u in stage_object.sharded_state().units if u.trained and all(n.startswith(prefix) for n in u.names)]


def _on_ranks():
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    grid = _grid()
    out = {"rank": dist.get_rank()}
    for stage in (0, 1, 2, 3):
        out[f"fp32-{stage}"] = _train_on_grid(grid, stage)
    for stage in (0, 1):
        out[f"fp16-{stage}"] = _train_on_grid(grid, stage, "fp16", overflow_step=1)

    # Per-unit divide factors, on the data groups alone: each engine holds the whole model
    # (both layers); layer 0's units sum their gradients, layer 1's average them.
    data_group = grid.get_data_parallel_group()
    for stage in (0, 1, 2, 3):
        model = _full_model()
        cfg = _config(stage, clip=None)
        cfg["zero_optimization"]["reduce_bucket_size"] = D * D  # one unit per weight
        engine, *_ = zerotrain.initialize(model=model, config=cfg, data_parallel_group=data_group)
        zero = engine.zero_stage_object
        if stage == 0:  # fp32 stage 0: no units, one factor for every bucket
            zero.set_gradient_divide_factor(1.0)
        else:
            zero.set_gradient_divide_factor(1.0, units=_units_named(zero, "0."))
        d = engine.topology.data_rank
        for step in range(2):
            x, y = _batches(step)
            rows = slice(d * MICRO, (d + 1) * MICRO)
            engine.backward(sum(_layer_loss(model[m], x[m, rows], y[m, rows]) for m in range(2)))
            engine.step()
        params = list(model.parameters())
        from zerotrain.zero import GatheredParameters

        with GatheredParameters(params, enabled=stage == 3):
            out[f"divide-{stage}"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine.destroy()
    return out


def test_grid_clips_with_the_whole_models_norm_and_overflow_skips_everywhere():
    per_rank = run_on_ranks(_on_ranks, world_size=4, timeout=600)
    ref_weights, ref_norms = [], []
    for steps in range(1, STEPS + 1):
        w, n = _reference(steps=steps, tie=True)
        ref_weights.append(w)
        ref_norms = n
    for out in per_rank:
        rank = out["rank"]
        for stage in (0, 1, 2, 3):
            got = out[f"fp32-{stage}"]
            m, d = got["coord"]
            assert (m, d) == (rank % 2, rank // 2), "row-major ranks with the model axis fastest"
            assert got["applied"] == [True] * STEPS
            assert "model 2" in got["save"] and "not supported" in got["save"], got["save"]
            for step in range(STEPS):
                assert abs(got["norms"][step] - ref_norms[step]) <= 1e-5 * ref_norms[step], (
                    rank,
                    stage,
                    step,
                    got["norms"][step],
                    ref_norms[step],
                )
                for name, value in got["weights"][step].items():
                    want = ref_weights[step][name]
                    assert torch.allclose(value, want, rtol=0, atol=1e-6), (rank, stage, step, name)
        for stage in (0, 1):
            got = out[f"fp16-{stage}"]
            # Step 1 overflowed on rank 1 (model 1, data 0) only: every rank skipped it and
            # halved its scale, and the weights stayed those of step 0.
            assert got["applied"] == [True, False, True], (rank, stage, got["applied"])
            assert got["scales"][1] == got["scales"][0] / 2, (rank, stage, got["scales"])
            for name, value in got["weights"][1].items():
                assert torch.equal(value, got["weights"][0][name]), (rank, stage, name)
                assert not torch.equal(value, got["weights"][2][name]), (rank, stage, name)
        # fp16 weights are close to the fp32 reference of their clean steps (a sanity check
        # that the skip did not leave garbage): step 0 equals reference step 0 roughly.
        fp16_ref = _reference(steps=1)[0]
        for name, value in out["fp16-1"]["weights"][0].items():
            assert torch.allclose(value, fp16_ref[name], atol=2e-3), (rank, name)

    divided, _ = _reference(clip=None, steps=2, sum_layers=(0,))
    for out in per_rank:
        for stage in (0, 1, 2, 3):
            got = out[f"divide-{stage}"]
            want = _reference(clip=None, steps=2, sum_layers=(0, 1))[0] if stage == 0 else divided
            for name, value in got.items():
                assert torch.allclose(value, want[name], rtol=0, atol=1e-6), (out["rank"], stage, name)


# -- one stage object holding units over different groups ---------------------------------
# Four data ranks; a shared layer reduced over all of them, and an "expert" layer each pair of
# ranks ({0,1}: expert 0, {2,3}: expert 1) holds alone, reduced over its pair and divided by 4
# (a divide factor that is not its group's size). One ZeroStage holds both kinds of unit.


def _expert_reference(steps: int = STEPS, clip: float = CLIP):
    torch.manual_seed(1)
    shared, experts = nn.Linear(D, D), [nn.Linear(D, D), nn.Linear(D, D)]
    params = list(shared.parameters()) + [p for e in experts for p in e.parameters()]
    norms = []
    for step in range(steps):
        x, y = _batches(step)  # [2, 6, D]: rank r's samples are x[r // 2, (r % 2) * 3: ...]
        loss = 0
        for r in range(4):
            rows = slice((r % 2) * MICRO, (r % 2 + 1) * MICRO)
            xr, yr = x[r // 2, rows], y[r // 2, rows]
            loss = loss + (_layer_loss(shared, xr, yr) + _layer_loss(experts[r // 2], xr, yr)) / 4
        for p in params:
            p.grad = None
        loss.backward()
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        norms.append(norm)
        with torch.no_grad():
            for p in params:
                p -= LR * min(clip / (norm + 1e-6), 1.0) * p.grad
    return shared, experts, norms


def _expert_stage_on_ranks():
    import torch.distributed as dist

    import zerotrain
    from zerotrain.zero.build import StageOptions, build_sharded_stage
    from zerotrain.zero.reduce_groups import UnitReduction
    from zerotrain.zero.strategy import STRATEGIES

    zerotrain.init_distributed()
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(1)
        shared, experts = nn.Linear(D, D), [nn.Linear(D, D), nn.Linear(D, D)]
        model = nn.ModuleDict({"shared": shared, "expert": experts[rank // 2]})
        expert_reduction = UnitReduction.over(pairs[rank // 2], divide_factor=4)
        expert_params = {id(p) for p in model["expert"].parameters()}
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        zero = build_sharded_stage(
            STRATEGIES[stage],
            model,
            optimizer,
            StageOptions(unit_numel=10**6),
            reduce_group_of=lambda p: expert_reduction if id(p) in expert_params else None,
        )
        assert len(zero.trained) == 2  # the two kinds never share a unit
        rows = slice((rank % 2) * MICRO, (rank % 2 + 1) * MICRO)
        norms = []
        for step in range(STEPS):
            x, y = _batches(step)
            xr, yr = x[rank // 2, rows], y[rank // 2, rows]
            zero.begin_backward(True, False)
            (_layer_loss(model["shared"], xr, yr) + _layer_loss(model["expert"], xr, yr)).backward()
            zero.end_backward()
            norm = float(zero.grad_norm())
            norms.append(norm)
            zero.step(optimizer, min(CLIP / (norm + 1e-6), 1.0))
            zero.zero_grad()
        try:
            zero.sharded_state()
            refused = ""
        except NotImplementedError as error:
            refused = str(error)
        zero.close()  # stage 3: every unit gathered back into whole parameters
        out[stage] = {
            "norms": norms,
            "refused": refused,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        }
    model = nn.ModuleDict({"shared": nn.Linear(D, D), "expert": nn.Linear(D, D)})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    spec = UnitReduction.over(pairs[rank // 2])
    # Units sharing one reduce_group_of answer still take their own divide factor.
    zero = build_sharded_stage(
        STRATEGIES[1], model, optimizer, StageOptions(unit_numel=1), reduce_group_of=lambda p: spec
    )
    zero.set_gradient_divide_factor(1.0, units=zero.trained[:1])
    out["factors"] = [zero.reduction_of(u).divide_factor for u in zero.trained]
    zero.close()
    return out


def test_one_stage_holds_units_over_different_groups():
    per_rank = run_on_ranks(_expert_stage_on_ranks, world_size=4, timeout=600)
    shared, experts, norms = _expert_reference()
    for rank, out in enumerate(per_rank):
        want = {
            **{f"shared.{n}": p for n, p in shared.named_parameters()},
            **{f"expert.{n}": p for n, p in experts[rank // 2].named_parameters()},
        }
        for stage in (0, 1, 2, 3):  # stage 3: the expert unit sharded and gathered over its pair
            got = out[stage]
            for step in range(STEPS):
                assert abs(got["norms"][step] - norms[step]) <= 1e-5 * norms[step], (rank, stage, step)
            for name, value in got["weights"].items():
                assert torch.allclose(value, want[name].detach(), rtol=0, atol=1e-6), (rank, stage, name)
            # checkpoints name expert units' shards themselves (zerotrain.checkpoint.experts)
            assert got["refused"] == "", got["refused"]
        assert len(out["factors"]) == 4 and out["factors"] == [1.0, 2.0, 2.0, 2.0], out["factors"]
