"""Engines on explicit data-parallel groups: ranks {0,1} and {2,3} of a 4-rank world each train
their own engine (different stages and precisions) side by side, and each matches single-process
training on its own global batches; ``mpu=`` supplies the group the same way."""

from __future__ import annotations

import torch

from tests.engine.test_combinations import MICRO, STEPS, _config, _reference
from tests.engine.workloads import global_batches, make_model
from zerotrain.testing import run_on_ranks

PLAN = {0: (2, "fp32"), 1: (3, "bf16")}  # group index -> (stage, precision)


class _DataParallelOnly:
    """A Megatron-style mpu that describes data parallelism only."""

    def __init__(self, group):
        self._group = group

    def get_data_parallel_group(self):
        return self._group

    def get_model_parallel_world_size(self):
        return 1


def _train_in_groups() -> dict:
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = dist.get_rank() // 2
    group = groups[mine]
    stage, precision = PLAN[mine]
    model = make_model()
    kwargs = {"data_parallel_group": group} if mine == 0 else {"mpu": _DataParallelOnly(group)}
    engine, *_ = zerotrain.initialize(model=model, config=_config(stage, precision, 1, "sgd"), **kwargs)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    data = global_batches(STEPS, MICRO * world)
    for step in range(STEPS):
        batch = data[step, rank * MICRO : (rank + 1) * MICRO]
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()
    state = engine.module_state_dict()  # stage 3: on the group's first rank
    out = {
        "group": mine,
        "dp_world_size": engine.dp_world_size,
        "params": {k: v.float().clone() for k, v in state.items()},
    }
    engine.destroy()
    return out


def test_two_engines_on_disjoint_groups_match_their_references():
    per_rank = run_on_ranks(_train_in_groups, world_size=4, timeout=300)
    ref = _reference(1, "sgd", world=2)
    init = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    for out in per_rank:
        assert out["dp_world_size"] == 2
    for first in (per_rank[0], per_rank[2]):  # each group's first rank holds its weights
        stage, precision = PLAN[first["group"]]
        got = first["params"]
        if precision == "fp32":
            for name, want in ref.items():
                assert float((got[name] - want).norm() / want.norm()) <= 1e-5, (stage, name)
        else:
            update = torch.cat([(got[n] - init[n]).flatten() for n in ref])
            want = torch.cat([(ref[n] - init[n]).flatten() for n in ref])
            assert 0.9 <= float(update.norm() / want.norm()) <= 1.1
            assert float(torch.nn.functional.cosine_similarity(update, want, dim=0)) > 0.99


def test_mpu_with_model_parallelism_is_refused_naming_it():
    import pytest

    from zerotrain.engine.initialize import build_topology

    class TensorParallel(_DataParallelOnly):
        def get_tensor_model_parallel_world_size(self):
            return 2

    # Refused before any group is touched (no process group needed).
    with pytest.raises(NotImplementedError, match="get_tensor_model_parallel_world_size.*PipelineParallelGrid"):
        build_topology(None, TensorParallel(None))
    with pytest.raises(ValueError, match="get_data_parallel_group"):
        build_topology(None, object())
    with pytest.raises(ValueError, match="pass the data-parallel group once"):
        build_topology(object(), _DataParallelOnly(object()))
