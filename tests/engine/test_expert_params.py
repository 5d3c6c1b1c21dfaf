"""Parameters carrying DeepSpeed's expert markers (``allreduce = False``, ``group_name =
"ep_size_N"``) train at ZeRO stages 0-2: their gradients are reduced over the expert-data-parallel
group and divided by the data-parallel size, dense ones averaged over the data group (issue 32).

The model routes its tokens to experts held by other ranks with a real all-to-all over the
expert-parallel group (token i of every rank goes to expert ``i % ep_size``), so each expert sees
the tokens routed to it from every rank of its expert group. The reference is one process holding
every expert, fed every rank's batch, with the loss the mean of the ranks' losses: its gradients
are what DeepSpeed's rule (expert sum over the expert-data group / data size) gives, and dividing
by the expert-data size instead would be ``ep_size`` times too large. Weights after 3 steps (SGD
with momentum and clipping active, AdamW; config-built and client optimizers with ``"moe": True``
groups) and ``get_global_grad_norm`` per step (each expert counted once) are compared.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.testing import run_on_ranks

# The autograd all-to-all (torch.distributed.nn.functional) warns of its successor on every call.
warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)

STEPS = 3
MICRO = 4  # tokens per rank: a multiple of every ep_size tested
HIDDEN = 6
STAGES = (0, 1, 2)
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("sgd", "adamw", "adamw-client")
SGD = {"lr": 0.05, "momentum": 0.9}
ADAMW = {"lr": 2e-2, "weight_decay": 0.1, "eps": 1e-6}
CLIP = 0.5


class ExpertModel(nn.Module):
    """dense -> experts (one per expert-parallel rank, tokens dispatched by all-to-all) -> dense.

    With ``ep_group`` None it is the one-process reference holding all ``ep_size`` experts."""

    def __init__(self, ep_size: int, ep_group=None, ep_rank: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.ep_size, self.ep_group = ep_size, ep_group
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        experts = [nn.Linear(HIDDEN, HIDDEN) for _ in range(ep_size)]
        self.out = nn.Linear(HIDDEN, 2)
        if ep_group is None:
            self.experts = nn.ModuleList(experts)
        else:
            self.experts = nn.ModuleList([experts[ep_rank]])
            for p in self.experts.parameters():
                p.allreduce = False
                p.group_name = f"ep_size_{ep_size}"

    def forward(self, x):
        h = torch.relu(self.inp(x))
        tokens = torch.arange(h.shape[0]) % self.ep_size
        order = torch.argsort(tokens, stable=True)
        grouped = h[order]
        if self.ep_group is None:
            parts = grouped.chunk(self.ep_size)
            routed = torch.cat([e(part) for e, part in zip(self.experts, parts)])
        else:
            from torch.distributed.nn.functional import all_to_all_single

            received = all_to_all_single(torch.empty_like(grouped), grouped, group=self.ep_group)
            done = self.experts[0](received)
            routed = all_to_all_single(torch.empty_like(done), done, group=self.ep_group)
        y = torch.empty_like(routed)
        y[order] = routed
        return self.out(h + torch.relu(y))


def _batches(world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, world, MICRO, HIDDEN, generator=g)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return 4 * out.square().mean()  # large enough that clipping at 1.0 acts


def _config(stage: int, precision: str, optimizer: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}}
    if optimizer == "sgd":
        cfg["optimizer"] = {"type": "SGD", "params": SGD}
    elif optimizer == "adamw":
        cfg["optimizer"] = {"type": "AdamW", "params": ADAMW}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _reference(ep_size: int, world: int, optimizer: str):
    """Weights after STEPS (expert keys as ``experts.<global index>``) and the norm per step."""
    model = ExpertModel(ep_size)
    opt = (
        torch.optim.SGD(model.parameters(), **SGD)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), **ADAMW)
    )
    norms = []
    for batch in _batches(world):
        opt.zero_grad()
        loss = torch.stack([_loss(model(batch[r])) for r in range(world)]).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _train_all(ep_sizes: tuple[int, ...]):
    import zerotrain
    from zerotrain.optim.expert_groups import split_params_into_different_moe_groups_for_optimizer

    zerotrain.init_distributed()
    world = dist.get_world_size()
    rank = dist.get_rank()
    out = {}
    from zerotrain.topology import Topology

    for ep_size in ep_sizes:
        # The model's own all-to-all group (the engine builds its expert groups itself).
        groups = Topology.from_group(None).expert_groups(ep_size)
        for stage in STAGES:
            for precision in PRECISIONS:
                for optimizer in OPTIMIZERS:
                    model = ExpertModel(ep_size, groups.expert_group, groups.expert_rank)
                    client = None
                    if optimizer == "adamw-client":
                        param_groups = split_params_into_different_moe_groups_for_optimizer(
                            {"params": list(model.parameters()), "name": "dense"}
                        )
                        assert any(g.get("moe") for g in param_groups)
                        client = torch.optim.AdamW(param_groups, **ADAMW)
                    engine, _, _, _ = zerotrain.initialize(
                        model=model, optimizer=client, config=_config(stage, precision, optimizer)
                    )
                    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
                    norms = []
                    for batch in _batches(world):
                        loss = _loss(engine(batch[rank].to(dtype)).float())
                        engine.backward(loss)
                        engine.step()
                        norms.append(float(engine.get_global_grad_norm()))
                    local = {k: p.detach().float().clone() for k, p in engine.module.named_parameters()}
                    out[(ep_size, stage, precision, optimizer)] = (groups.expert_rank, local, norms)
                    engine.destroy()
    return out


def _check(per_rank: list[dict], world: int) -> list[str]:
    failures = []
    references = {}
    for key in per_rank[0]:
        ep_size, stage, precision, optimizer = key
        ref_opt = "sgd" if optimizer == "sgd" else "adamw"
        if (ep_size, ref_opt) not in references:
            references[(ep_size, ref_opt)] = _reference(ep_size, world, ref_opt)
        want, want_norms = references[(ep_size, ref_opt)]
        initial = ExpertModel(ep_size).state_dict()
        assert min(want_norms) > 1.5 * CLIP, want_norms  # clipping acts at every step
        for rank, results in enumerate(per_rank):
            expert, got, norms = results[key]
            what = f"ep_size={ep_size} stage={stage} {precision} {optimizer} rank {rank}"
            mapping = {k: k.replace("experts.0.", f"experts.{expert}.") for k in got}
            if precision == "fp32":
                for k, v in got.items():
                    if not torch.allclose(v, want[mapping[k]], rtol=1e-5, atol=1e-6):
                        diff = float((v - want[mapping[k]]).abs().max())
                        failures.append(f"{what}: {k} differs by {diff:.3g}")
                for step, (n, m) in enumerate(zip(norms, want_norms)):
                    if abs(n - m) > 1e-5 * m:
                        failures.append(f"{what}: step {step} grad norm {n:.6f} != reference {m:.6f}")
            else:
                update = torch.cat([(got[k] - initial[mapping[k]]).flatten() for k in got])
                ref = torch.cat([(want[mapping[k]] - initial[mapping[k]]).flatten() for k in got])
                size = float(update.norm() / ref.norm())
                cosine = float(torch.nn.functional.cosine_similarity(update, ref, dim=0))
                if not (0.9 <= size <= 1.1 and cosine > 0.99):
                    failures.append(f"{what}: update size {size:.4f}x the reference's, cosine {cosine:.4f}")
                for step, (n, m) in enumerate(zip(norms, want_norms)):
                    if abs(n - m) > 0.05 * m:
                        failures.append(f"{what}: step {step} grad norm {n:.6f} != reference {m:.6f}")
    return failures


def test_two_ranks_each_holding_its_expert():
    per_rank = run_on_ranks(_train_all, 2, args=((2,),), timeout=900)
    assert not _check(per_rank, 2), "\n".join(_check(per_rank, 2))


def test_four_ranks_expert_data_groups_of_one_and_two():
    per_rank = run_on_ranks(_train_all, 4, args=((4, 2),), timeout=1500)
    failures = _check(per_rank, 4)
    assert not failures, "\n".join(failures)
