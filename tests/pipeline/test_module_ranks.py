"""``PipelineModule`` on 2 ranks (P=2) and 4 ranks (P=2 x D=2, then P=4 and P=1 on the same
processes): each stage holds its own layers under DeepSpeed's names, running the stages one
after another (activations sent between ranks here) equals the layers run in one process,
``seed_layers`` gives the same weights for every P, tied embeddings stay one value with summed
gradients, and layer files written at one P load at another."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zerotrain.pipeline import LayerSpec, PipelineModule, TiedLayerSpec, partition_balanced
from zerotrain.seeding import set_random_seed
from zerotrain.testing import run_on_ranks

VOCAB, WIDTH, BATCH, SEQ = 11, 6, 3, 5
PARAMS = [VOCAB * WIDTH, WIDTH * WIDTH + WIDTH, 0, WIDTH * WIDTH + WIDTH, 0, 2 * WIDTH, VOCAB * WIDTH]


def _half(x):
    return x * 0.5


def _head(embedding, x):
    return x @ embedding.weight.t()


def _specs():
    """A tiny GPT: embedding, blocks, norm, and the embedding again as the output head."""
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        nn.Tanh(),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        _half,
        LayerSpec(nn.LayerNorm, WIDTH),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=_head),
    ]


def _reference(transform=None) -> dict[str, nn.Module]:
    """Every layer built in one process with DeepSpeed's seeds (base 1234 + layer index); the
    tied embedding is layer 0's. ``transform`` maps each parameter (as the checkpoint test edits)."""
    layers = {}
    for idx, spec in enumerate(_specs()[:6]):
        set_random_seed(1234 + idx)
        layers[idx] = spec.build() if isinstance(spec, LayerSpec) else spec
    if transform is not None:
        with torch.no_grad():
            for layer in layers.values():
                if isinstance(layer, nn.Module):
                    for p in layer.parameters():
                        p.copy_(transform(p))
    return layers


def _reference_forward(layers, ids):
    x = ids
    for idx in range(6):
        x = layers[idx](x)
    return _head(layers[0], x)


def _reference_state(layers) -> dict[str, torch.Tensor]:
    """State-dict keys as a PipelineModule holding every layer names them."""
    state = {f"tied_modules.embed.{k}": v for k, v in layers[0].state_dict().items()}
    for idx in (1, 3, 5):
        state.update({f"{idx}.{k}": v for k, v in layers[idx].state_dict().items()})
    return state


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _assert_weights(module, reference_state, atol=0.0):
    state = module.state_dict()
    assert state, "no local weights"
    for key, value in state.items():
        assert torch.allclose(value, reference_state[key], rtol=0, atol=atol), key


def _stage_by_stage(module, ids):
    """Run ``module``'s stage; activations go to the same replica's next stage. The last stage
    returns its output and the others None."""
    grid, stage, stages = module.mpu(), module.stage_id, module.num_stages
    if stage == 0:
        x = ids
    else:
        x = torch.empty(BATCH, SEQ, WIDTH)
        dist.recv(x, src=grid.stage_to_global(stage - 1))
        x.requires_grad_(True)
    out = module(x)
    if stage < stages - 1:
        dist.send(out.detach().contiguous(), dst=grid.stage_to_global(stage + 1))
        return x, out, None
    return x, out, out


def _two_ranks(save_dir):
    import zerotrain

    zerotrain.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # anything not seeded differs between the ranks
    reference = _reference()
    ref_state = _reference_state(reference)

    # errors: one line, raised on every rank before any group exists
    with pytest.raises(RuntimeError, match="num_stages=3 does not divide the world size 2; choose num_stages"):
        PipelineModule(_specs(), num_stages=3)
    from zerotrain.topology import PipeDataParallelTopology

    with pytest.raises(ValueError, match="the topology has 4 ranks but the world has 2"):
        PipelineModule(_specs(), topology=PipeDataParallelTopology(2, 2))

    module = PipelineModule(_specs(), num_stages=2, seed_layers=True)
    assert module.parts == partition_balanced(PARAMS, 2) == [0, 3, 7]
    assert module.stage_id == rank and module.global_rank == rank and module.num_stages == 2
    assert [module.stage_owner(i) for i in range(7)] == [0, 0, 0, 1, 1, 1, 1]
    expected_keys = (
        ["tied_modules.embed.weight", "1.weight", "1.bias"]
        if rank == 0
        else ["tied_modules.embed.weight", "3.weight", "3.bias", "5.weight", "5.bias"]
    )
    assert list(module.state_dict()) == expected_keys
    assert (module._local_start, module._local_stop) == ((0, 3) if rank == 0 else (3, 7))
    assert len(module.forward_funcs) == (3 if rank == 0 else 4)
    # stage 1 built its embedding from seed 1234 + 6, then took stage 0's (seed 1234 + 0)
    _assert_weights(module, ref_state)
    tied = module.tied_modules["embed"]
    assert [p.ds_pipe_replicated for p in tied.parameters()] == [rank == 1]
    assert all(p.ds_pipe_replicated is False for n, p in module.named_parameters() if not n.startswith("tied"))
    comm = module.tied_comms["embed"]
    assert list(module.tied_comms) == ["embed"] and comm["ranks"] == [0, 1] and comm["weight_attr"] == ["weight"]
    assert comm["module"] is tied
    [(weight, group)] = module.get_tied_weights_and_groups()
    assert weight is tied.weight and group is comm["group"] and dist.get_world_size(group) == 2

    # forward stage by stage, then backward stage by stage, against one process
    ids = _ids(0)
    x, out, last = _stage_by_stage(module, ids)
    if rank == 1:
        expected = _reference_forward(reference, ids)
        assert torch.allclose(last, expected, rtol=0, atol=1e-6)
        last.square().mean().backward()
        dist.send(x.grad.contiguous(), dst=0)
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=1)
        out.backward(grad)
    _reference_forward(reference, ids).square().mean().backward()
    ref_grads = {k: v.grad for k, v in _named_reference_params(reference).items()}
    own_embed_grad = tied.weight.grad.clone()
    module.allreduce_tied_weight_gradients()
    for name, p in module.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name], rtol=0, atol=1e-6), name
    assert not torch.allclose(own_embed_grad, ref_grads["tied_modules.embed.weight"])  # each stage had a part

    # allreduce_tied_weight_gradients sums (a replica without a gradient counts zeros)
    tied.weight.grad = torch.full_like(tied.weight, float(rank + 1)) if rank == 0 else None
    module.allreduce_tied_weight_gradients()
    assert torch.equal(tied.weight.grad, torch.full_like(tied.weight, 1.0))

    # a LayerSpec is built only on its stage ("parameters" first builds every spec once to count)
    _Counted.built = 0
    counted = [LayerSpec(_Counted, 2, 2) for _ in range(5)]
    PipelineModule(counted, num_stages=2, partition_method="uniform")
    assert _Counted.built == (3 if rank == 0 else 2)
    _Counted.built = 0
    PipelineModule(counted, num_stages=2, partition_method="parameters")
    assert _Counted.built == 5 + (3 if rank == 0 else 2)

    # type:<regex> balances the matching layers (Linear x2, LayerNorm)
    typed = PipelineModule(_specs(), num_stages=2, partition_method="type:linear|NORM")
    assert typed.parts == partition_balanced([0, 1, 0, 1, 0, 1, 0], 2)
    uniform = PipelineModule(_specs(), num_stages=2, partition_method="uniform")
    assert uniform.parts == [0, 4, 7]

    # a tied module whose lowest stage runs it only through forward_fn (no file of its own there):
    # that stage loads it from the other occurrence's file before the broadcast
    fn_first = [
        TiedLayerSpec("embed", nn.Linear, WIDTH, WIDTH, forward_fn=_twice),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        TiedLayerSpec("embed", nn.Linear, WIDTH, WIDTH),
    ]
    written = PipelineModule(fn_first, num_stages=2, partition_method="uniform")
    assert written.parts == [0, 2, 3]
    with torch.no_grad():
        for p in written.tied_modules["embed"].parameters():
            p.fill_(0.125)
    written.save_state_dict(os.path.join(save_dir, "fn_first"))
    dist.barrier()
    loaded = PipelineModule(fn_first, num_stages=2, partition_method="uniform")
    loaded.load_state_dir(os.path.join(save_dir, "fn_first"))
    assert all(torch.equal(p, torch.full_like(p, 0.125)) for p in loaded.tied_modules["embed"].parameters())
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(os.path.join(save_dir, "fn_first"))

    module.save_state_dict(save_dir)
    dist.barrier()
    return sorted(os.listdir(save_dir))


class _Counted(nn.Linear):
    built = 0

    def __init__(self, *args):
        super().__init__(*args)
        type(self).built += 1


def _twice(linear, x):
    return linear(linear(x))


def _named_reference_params(reference) -> dict[str, torch.Tensor]:
    named = {f"tied_modules.embed.{k}": v for k, v in reference[0].named_parameters()}
    for idx in (1, 3, 5):
        named.update({f"{idx}.{k}": v for k, v in reference[idx].named_parameters()})
    return named


def _transform(p):
    return p * -1.5 + 0.25


def _four_ranks(save_dir):
    import zerotrain
    from zerotrain.pipeline import layer_files

    zerotrain.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    ref_state = _reference_state(_reference())

    # P=2 x D=2: stage 0 is ranks {0, 1}, stage 1 {2, 3}; the pipelines are {0, 2} and {1, 3}
    m2 = PipelineModule(_specs(), num_stages=2, seed_layers=True)
    grid = m2.mpu()
    assert (m2.stage_id, grid.get_data_parallel_id()) == (rank // 2, rank % 2)
    assert grid.get_data_parallel_world_size() == 2 and m2.topology().get_dim("data") == 2
    _assert_weights(m2, ref_state)
    tied = m2.tied_modules["embed"]
    assert m2.tied_comms["embed"]["ranks"] == [rank % 2, 2 + rank % 2]
    assert [p.ds_pipe_replicated for p in tied.parameters()] == [rank >= 2]
    ids = _ids(10 + rank % 2)  # each replica its own batch
    _, _, last = _stage_by_stage(m2, ids)
    if m2.stage_id == 1:
        assert torch.allclose(last, _reference_forward(_reference(), ids), rtol=0, atol=1e-6)
    tied.weight.grad = torch.full_like(tied.weight, float(rank + 1))
    m2.allreduce_tied_weight_gradients()
    assert torch.equal(tied.weight.grad, torch.full_like(tied.weight, [4.0, 6.0][rank % 2]))

    # save edited weights: the data group's first rank writes its stage's layers
    with torch.no_grad():
        for p in m2.parameters():
            p.copy_(_transform(p))
    written = []
    original = layer_files._save_atomically
    layer_files._save_atomically = lambda state, path: (written.append(os.path.basename(path)), original(state, path))
    try:
        m2.save_state_dict(save_dir)
    finally:
        layer_files._save_atomically = original
    assert (
        written
        == {
            0: ["layer_00-model_states.pt", "layer_01-model_states.pt", "layer_02-model_states.pt"],
            1: [],
            2: ["layer_03-model_states.pt", "layer_05-model_states.pt"],
            3: [],
        }[rank]
    )
    dist.barrier()
    saved_state = _reference_state(_reference(_transform))

    # P=4 and P=1 on the same processes: the same initial weights, then the saved ones
    for stages in (4, 1):
        module = PipelineModule(_specs(), num_stages=stages, seed_layers=True)
        _assert_weights(module, ref_state)
        module.load_state_dir(save_dir)
        _assert_weights(module, saved_state, atol=1e-6)
        if stages == 4:
            assert module.parts == partition_balanced(PARAMS, 4) == [0, 1, 3, 6, 7]
            assert (module.tied_comms["embed"]["ranks"] == [0, 3]) if rank in (0, 3) else (module.tied_comms == {})
            # stage 3 runs the embedding only as the head (no file of its own): loaded all the same
            assert list(module.state_dict()) == (
                ["tied_modules.embed.weight"]
                if rank in (0, 3)
                else {1: ["1.weight", "1.bias"], 2: ["3.weight", "3.bias", "5.weight", "5.bias"]}[rank]
            )
        else:
            assert module.tied_comms == {} and module.parts == [0, 7]
        _, _, last = _stage_by_stage(module, _ids(20))
        if last is not None:
            expected = _reference_forward(_reference(_transform), _ids(20))
            assert torch.allclose(last, expected, rtol=0, atol=1e-5)
    listing = sorted(os.listdir(save_dir))

    # a model axis (pipe 2 x data 1 x model 2): DeepSpeed's file names carry the model rank, and
    # each model slice reads back its own file
    from zerotrain.topology import PipeModelDataParallelTopology

    sliced = PipelineModule(
        _specs(), topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1), seed_layers=True
    )
    stage, model_rank = rank // 2, rank % 2
    assert (sliced.stage_id, sliced.mpu().get_slice_parallel_rank()) == (stage, model_rank)
    assert sliced.ckpt_layer_path("d", 0) == os.path.join(
        "d", f"layer_0{3 * stage}-model_0{model_rank}-model_states.pt"
    )
    assert sliced.ckpt_prefix("d", "t") == os.path.join("d", "t", f"module-pipe_0{stage}-model_0{model_rank}")
    assert sliced.tied_comms["embed"]["ranks"] == [model_rank, 2 + model_rank]
    model_dir = os.path.join(save_dir, "model_axis")
    with torch.no_grad():
        for p in sliced.parameters():
            p.add_(float(model_rank))  # slices differ
    sliced.save_state_dict(model_dir)
    dist.barrier()
    reloaded = PipelineModule(
        _specs(), topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1), seed_layers=True, base_seed=4321
    )
    reloaded.load_state_dir(model_dir)
    for a, b in zip(sliced.state_dict().values(), reloaded.state_dict().values()):
        assert torch.equal(a, b)
    dist.barrier()
    if rank == 0:
        assert sorted(os.listdir(model_dir)) == sorted(
            f"layer_0{i}-model_0{m}-model_states.pt" for i in (0, 1, 2, 3, 5) for m in (0, 1)
        )
    return listing


def test_two_stages_hold_their_layers_run_as_one_model_and_tie_the_embedding(tmp_path):
    files = run_on_ranks(_two_ranks, world_size=2, args=(str(tmp_path),), timeout=300)
    assert files[0] == files[1] == [f"layer_0{i}-model_states.pt" for i in (0, 1, 2, 3, 5)]
    # the two stages' files load into one stage in this (non-distributed) process
    module = PipelineModule(_specs(), num_stages=1, seed_layers=True, base_seed=3)
    module.load_state_dir(str(tmp_path))
    _assert_weights(module, _reference_state(_reference()))


def test_pipe_by_data_then_four_and_one_stages_share_seeds_and_layer_files(tmp_path):
    files = run_on_ranks(_four_ranks, world_size=4, args=(str(tmp_path),), timeout=600)
    assert all(f == [f"layer_0{i}-model_states.pt" for i in (0, 1, 2, 3, 5)] for f in files)
