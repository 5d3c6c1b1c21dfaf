"""Stage 3 looks an embedding's rows up from the shards instead of gathering its table
(zero/embedding_lookup.py), on two ranks:

- training matches a single-process fp32 reference (losses and weights), SGD and AdamW, with a
  tied head (GPT-2) and an untied one, with a vocabulary whose rows the shard edge cuts (511 x 32
  over two ranks: 255.5 rows each) and one it does not (512);
- the token embedding is then gathered only where its table is read as a matrix: by the tied
  head in forward, never by the untied embedding;
- looked-up rows are the table's rows bit for bit, also when the ranks have different numbers of
  tokens, in fp32 and in bf16 (the shard derived from the fp32 master);
- ``padding_idx`` keeps its row's gradient at zero (a model with a pad token, like Llama's);
- a batch whose lookup would move more than a quarter of the table gathers it instead;
- ``destroy()`` gives nn.Embedding's own forward back.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.engine.workloads import reference_run
from zerotrain.testing import run_on_ranks

STEPS = 3
OPTIMIZERS = {
    "adamw": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "sgd": {"type": "SGD", "params": {"lr": 0.1}},
}
CASES = [(512, True, "adamw"), (511, True, "sgd"), (511, False, "adamw"), (512, False, "sgd")]


class _Padded(nn.Module):
    """Token embedding with a pad row, untied head, cross-entropy: what a Llama-style model does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(300, 16, padding_idx=0)
        self.head = nn.Linear(16, 300)

    def forward(self, ids, labels=None):
        logits = self.head(torch.tanh(self.embed(ids)))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def _ranks():
    import torch.distributed as dist

    import zerotrain
    from tests.engine.workloads import adamw_config, global_batches, make_model
    from zerotrain.zero.partition import FlatParamUnit
    from zerotrain.zero.stage3 import in_backward

    zerotrain.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    gathers = []
    start_gather = FlatParamUnit.start_gather

    def counting(unit, *args, **kwargs):
        gathers.append((unit, "backward" if in_backward() else "forward"))
        return start_gather(unit, *args, **kwargs)

    FlatParamUnit.start_gather = counting
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    out = {}
    try:
        for vocab, tied, name in CASES:
            model = make_model(vocab_size=vocab, tie_word_embeddings=tied)
            engine, *_ = zerotrain.initialize(
                model=model, config=adamw_config(2, zero_optimization=zero, optimizer=OPTIMIZERS[name])
            )
            wte = engine._zero.coordinator._unit_of[id(model.wte.weight)]
            data = global_batches(STEPS, 2 * world, vocab=vocab)
            losses, wte_gathers = [], []
            for step in range(STEPS):
                batch = data[step, rank * 2 : rank * 2 + 2]
                gathers.clear()
                loss = engine(batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
                wte_gathers.append([phase for unit, phase in gathers if unit is wte])
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(mean.item() / world)
            out[(vocab, tied, name)] = {
                "losses": losses,
                "wte_gathers": wte_gathers,
                "params": engine.module_state_dict(),
            }
            if (vocab, tied) == (511, True):
                out["rows"] = _rows(engine, model, rank, gathers, wte)
            engine.destroy()
            out.setdefault("forward_restored", []).append(
                "forward" not in vars(model.wte) and "forward" not in vars(model.wpe)
            )
        # bf16: the shard is derived from the fp32 master; rows still exact.
        model = make_model(vocab_size=511)
        engine, *_ = zerotrain.initialize(
            model=model, config=adamw_config(2, zero_optimization=zero, bf16={"enabled": True})
        )
        out["rows_bf16"] = _rows(engine, model, rank, gathers, engine._zero.coordinator._unit_of[id(model.wte.weight)])
        engine.destroy()
        # A pad token: its row's gradient stays zero, as in nn.Embedding.
        model = _Padded()
        engine, *_ = zerotrain.initialize(
            model=model, config=adamw_config(2, zero_optimization=zero, optimizer=OPTIMIZERS["sgd"])
        )
        ids = _padded_batches(world)[rank]
        for _ in range(STEPS):
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
        out["padded"] = engine.module_state_dict()
        engine.destroy()
    finally:
        FlatParamUnit.start_gather = start_gather
    return out


def _rows(engine, model, rank, gathers, wte):
    """Looked-up rows against the whole table: an uneven number of tokens per rank, then a
    batch too large for the lookup (which gathers the table)."""
    import zerotrain

    g = torch.Generator().manual_seed(5 + rank)
    ids = torch.randint(0, model.wte.num_embeddings, (3 + 4 * rank,), generator=g)
    # The first and last rows, and the row the two shards share (511 rows: row 255).
    ids[:3] = torch.tensor([0, model.wte.num_embeddings - 1, model.wte.num_embeddings // 2])
    large = torch.randint(0, model.wte.num_embeddings, (8, 64), generator=g)
    with torch.no_grad():
        engine.module.eval()
        gathers.clear()
        looked_up = model.wte(ids)
        lookup_gathers = sum(unit is wte for unit, _ in gathers)
        gathers.clear()
        gathered = model.wte(large)
        large_gathers = sum(unit is wte for unit, _ in gathers)
        engine.module.train()
    with zerotrain.zero.GatheredParameters([model.wte.weight]):
        table = model.wte.weight.detach().clone()
    return {
        "looked_up": torch.equal(looked_up, table[ids]),
        "dtype": str(looked_up.dtype),
        "lookup_gathers": lookup_gathers,
        "large": torch.equal(gathered, table[large]),
        "large_gathers": large_gathers,
    }


def _padded_batches(world):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (world, 2, 8), generator=g)
    ids[:, :, -3:] = 0  # padded tails
    return ids


def _padded_reference(world):
    model = _Padded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = _padded_batches(world).view(world * 2, 8)
    for _ in range(STEPS):
        loss = model(ids, labels=ids)
        loss.backward()
        assert model.embed.weight.grad[0].abs().sum() == 0
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _close(got, want, rtol=1e-5):
    assert all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, want)) and len(got) == len(want), (got, want)


def test_embedding_rows_are_looked_up_from_the_shards():
    results = run_on_ranks(_ranks, 2)
    for rank, out in enumerate(results):
        for vocab, tied, name in CASES:
            run = out[(vocab, tied, name)]
            # The tied table is read whole by the head only (forward; kept into backward from
            # the second step); the untied embedding's table is never gathered.
            want = [["forward", "backward"]] + [["forward"]] * (STEPS - 1) if tied else [[]] * STEPS
            assert run["wte_gathers"] == want, (vocab, tied, name, run["wte_gathers"])
            losses, params = reference_run(STEPS, 4, OPTIMIZERS[name], vocab_size=vocab, tie_word_embeddings=tied)
            _close(run["losses"], losses)
            if rank == 0:  # the consolidated state dict is rank 0's
                assert params.keys() == run["params"].keys() and params
                for key, value in params.items():
                    torch.testing.assert_close(run["params"][key], value, rtol=1e-4, atol=1e-5)
        assert out["forward_restored"] == [True] * len(CASES)
        for key, dtype in (("rows", "torch.float32"), ("rows_bf16", "torch.bfloat16")):
            rows = out[key]
            assert rows["looked_up"] and rows["dtype"] == dtype and rows["lookup_gathers"] == 0, rows
            assert rows["large"] and rows["large_gathers"] == 1, rows
        # Each rank's loss is its own half's mean: compared through the weights.
        if rank == 0:
            params, got = _padded_reference(2), out["padded"]
            assert params.keys() == got.keys() and params
            for key, value in params.items():
                torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5)
            assert torch.equal(got["embed.weight"][0], params["embed.weight"][0])  # the pad row never moved
