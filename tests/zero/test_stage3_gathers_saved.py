"""Gathers stage 3 leaves out:

- the unit backward gathers first (the output layer's) stays gathered from the end of forward
  to the start of backward instead of being released and gathered again at once: from the
  second step on (once both passes' orders are recorded) it is gathered in forward only, with a
  tied output layer (the embedding's unit) and an untied one;
- an embedding's own unit (the position embedding; the token embedding when untied) is not
  gathered for its backward, which reads indices, not weights; every other unit is gathered once
  per pass, and nothing is left gathered between steps;
- between forward and backward it is the only unit holding memory;
- a forward that no backward follows (an evaluation under grad) does not leave it stale: a
  checkpoint loaded after it is what the next forward computes with;
- training matches a single-process fp32 reference, with SGD and with AdamW.
"""

from __future__ import annotations

import torch

from tests.engine.workloads import reference_run
from zerotrain.testing import run_on_ranks

STEPS = 3
OPTIMIZERS = {
    "adamw": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "sgd": {"type": "SGD", "params": {"lr": 0.1}},
}


def _train(ckpt_dir: str):
    import torch.distributed as dist

    import zerotrain
    from tests.engine.workloads import adamw_config, global_batches, make_model
    from zerotrain.zero.partition import FlatParamUnit
    from zerotrain.zero.stage3 import in_backward

    zerotrain.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    gathers = []  # (unit, "forward" | "backward") per all-gather started, this rank
    start_gather = FlatParamUnit.start_gather

    def counting(unit, *args, **kwargs):
        gathers.append((unit, "backward" if in_backward() else "forward"))
        return start_gather(unit, *args, **kwargs)

    FlatParamUnit.start_gather = counting
    out = {}
    try:
        for tied in (True, False):
            for name, optimizer in OPTIMIZERS.items():
                model = make_model(tie_word_embeddings=tied)
                config = adamw_config(
                    2, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}, optimizer=optimizer
                )
                engine, *_ = zerotrain.initialize(model=model, config=config)
                coordinator = engine._zero.coordinator
                head = coordinator._unit_of[id(model.lm_head.weight)]
                data = global_batches(STEPS, 2 * world)
                per_step, losses, held_after_forward = [], [], []
                for step in range(STEPS):
                    batch = data[step, rank * 2 : rank * 2 + 2]
                    gathers.clear()
                    loss = engine(batch, labels=batch).loss
                    held_after_forward.append(
                        sorted(
                            coordinator._position[u]
                            for u in coordinator.units
                            if u.flat is not None and u.flat.untyped_storage().nbytes() > 0
                        )
                    )
                    engine.backward(loss)
                    engine.step()
                    per_step.append([(coordinator._position[u], phase) for u, phase in gathers])
                    mean = loss.detach().clone()
                    dist.all_reduce(mean)
                    losses.append(mean.item() / world)
                embeddings = [model.wpe] + ([] if tied else [model.wte])
                run = {
                    "per_step": per_step,
                    "held_after_forward": held_after_forward,
                    "head": coordinator._position[head],
                    "units": len(coordinator.units),
                    "embedding_only": sorted(
                        coordinator._position[coordinator._unit_of[id(m.weight)]] for m in embeddings
                    ),
                    "hollowed": coordinator.hollowed,
                    "gathered_after_step": sum(u.gathered for u in coordinator.units),
                    "losses": losses,
                    "params": engine.module_state_dict(),
                }  # consolidated on rank 0
                if tied and name == "adamw":
                    run["reloaded"] = _evaluate_then_load(engine, data[0, rank * 2 : rank * 2 + 2], ckpt_dir)
                out[(tied, name)] = run
                engine.destroy()
    finally:
        FlatParamUnit.start_gather = start_gather
    return out


def _evaluate_then_load(engine, batch, ckpt_dir):
    """The loss at a checkpoint, against the loss after: a step, a forward under grad that
    no backward follows, loading that checkpoint, and a forward."""
    with torch.no_grad():
        at_save = engine(batch, labels=batch).loss.item()
    engine.save_checkpoint(ckpt_dir, tag="saved")
    loss = engine(batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    engine(batch, labels=batch)  # an evaluation that forgot no_grad: no backward follows
    engine.load_checkpoint(ckpt_dir, tag="saved")
    with torch.no_grad():
        after_load = engine(batch, labels=batch).loss.item()
    return at_save, after_load


def test_the_first_unit_of_backward_stays_gathered_from_forward(tmp_path):
    results = run_on_ranks(_train, 2, args=(str(tmp_path),))
    for rank, rank_result in enumerate(results):
        assert len(rank_result) == 4
        for (tied, name), run in rank_result.items():
            head, units, embedding_only = run["head"], run["units"], run["embedding_only"]
            assert len(embedding_only) == (1 if tied else 2) and head not in embedding_only
            first, later = run["per_step"][0], run["per_step"][1:]
            # The first step records the orders: the head unit is gathered again in backward.
            assert first.count((head, "backward")) == 1
            for step, gathers in enumerate(run["per_step"]):
                # The head: in forward by the output layer (and by the embedding, when tied).
                assert gathers.count((head, "forward")) == (2 if tied else 1), (tied, name, gathers)
                assert gathers.count((head, "backward")) == (step == 0), (tied, name, step, gathers)
                for position in range(units):
                    if position == head:
                        continue
                    # Embeddings' own units in forward only: their backward reads no weights.
                    backward = 0 if position in embedding_only else 1
                    assert gathers.count((position, "forward")) == 1, (tied, name, position, gathers)
                    assert gathers.count((position, "backward")) == backward, (tied, name, position, gathers)
            # One gather a step fewer than the first step, which gathered the head in backward.
            assert all(len(gathers) == len(first) - 1 for gathers in later)
            # Emptied instead of gathered: each step, the embeddings' own units, and when tied the
            # shared unit after the output layer's backward.
            assert run["hollowed"] == STEPS * (len(embedding_only) + tied), run["hollowed"]
            assert run["held_after_forward"][0] == []
            assert all(held == [head] for held in run["held_after_forward"][1:])
            assert run["gathered_after_step"] == 0

            losses, params = reference_run(STEPS, 4, OPTIMIZERS[name], tie_word_embeddings=tied)
            for got, want in zip(run["losses"], losses):
                assert abs(got - want) <= 1e-5 * abs(want), (tied, name, run["losses"], losses)
            if rank > 0:
                continue  # the consolidated state dict is rank 0's
            assert params.keys() == run["params"].keys() and params
            for key, want in params.items():
                torch.testing.assert_close(run["params"][key], want, rtol=1e-4, atol=1e-5)
        at_save, after_load = rank_result[(True, "adamw")]["reloaded"]
        assert after_load == at_save
