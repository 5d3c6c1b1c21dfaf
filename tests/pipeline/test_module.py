"""``PipelineModule`` in one process (one stage): layers, names, forward, seeds, activation
checkpoints, layer files and the one-line errors. The multi-rank behaviour is in
test_module_ranks.py."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from zerotrain.pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from zerotrain.seeding import set_random_seed
from zerotrain.topology import PipeDataParallelTopology, ProcessTopology


def _half(x):
    return x * 0.5


def _specs():
    return [
        LayerSpec(nn.Linear, 4, 6),
        nn.Tanh(),
        LayerSpec(nn.Linear, 6, 6),
        _half,
        LayerSpec(nn.Dropout, 0.5),
        LayerSpec(nn.Linear, 6, 3),
    ]


def _reference(specs, base_seed=1234) -> nn.Sequential:
    """The same layers built in order with DeepSpeed's per-layer seeds."""
    layers = []
    for idx, spec in enumerate(specs):
        set_random_seed(base_seed + idx)
        layers.append(spec.build() if isinstance(spec, LayerSpec) else spec)
    return layers


def _run(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def test_one_stage_holds_every_layer_under_deepspeeds_names():
    module = PipelineModule(_specs(), num_stages=1, seed_layers=True)
    assert module.num_stages == 1 and module.stage_id == 0 and module.num_pipeline_stages() == 1
    assert module.parts == module.partitions() == [0, 6]
    assert (module._local_start, module._local_stop) == (0, 6)
    assert list(module.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias", "5.weight", "5.bias"]
    assert [type(f).__name__ for f in module.forward_funcs] == [
        "Linear",
        "Tanh",
        "Linear",
        "function",
        "Dropout",
        "Linear",
    ]
    assert module.forward_funcs[3] is _half and module.fwd_map == {"0": 0, "1": 1, "2": 2, "4": 4, "5": 5}
    assert all(p.ds_pipe_replicated is False for p in module.parameters())
    assert module.tied_comms == {} and module.get_tied_weights_and_groups() == []
    assert module.get_additional_losses() is None and module.global_rank == 0
    assert [module.stage_owner(i) for i in range(6)] == [0] * 6
    assert isinstance(module.topology(), PipeDataParallelTopology) and module.mpu().get_stage_id() == 0
    # seed_layers: each layer's weights are those built after set_random_seed(1234 + idx)
    reference = _reference(_specs())
    for idx in (0, 2, 5):
        assert torch.equal(getattr(module, str(idx)).weight, reference[idx].weight)
        assert torch.equal(getattr(module, str(idx)).bias, reference[idx].bias)


def test_forward_equals_the_layers_run_in_order_with_deepspeeds_dropout_seeds():
    module = PipelineModule(_specs(), num_stages=1, seed_layers=True, base_seed=7)
    reference = _reference(_specs(), base_seed=7)
    x = torch.randn(5, 4)
    for micro in (1, 2):
        out = module(x)
        assert module.micro_offset == micro
        # DeepSpeed reseeds base_seed * (micro_offset + 1) + layer_idx before each layer
        expected = x
        for idx, layer in enumerate(reference):
            set_random_seed(7 * (micro + 1) + idx)
            expected = layer(expected)
        assert torch.equal(out, expected)
    module.eval()
    assert torch.allclose(module(x), _run([m.eval() if isinstance(m, nn.Module) else m for m in reference], x))


def test_activation_checkpoint_blocks_match_deepspeed_and_change_no_number():
    calls = []

    def recording_checkpoint(function, *args):
        calls.append(len(args))
        from zerotrain.recompute import checkpoint

        return checkpoint(function, *args)

    specs = [LayerSpec(nn.Linear, 4, 6), nn.Tanh(), _half, _half, LayerSpec(nn.Linear, 6, 3)]
    plain = PipelineModule(specs, num_stages=1, seed_layers=True)
    ckpt = PipelineModule(
        specs,
        num_stages=1,
        seed_layers=True,
        activation_checkpoint_interval=2,
        activation_checkpoint_func=recording_checkpoint,
    )
    x = torch.randn(3, 4, requires_grad=True)
    y_plain = plain(x)
    y_plain.square().sum().backward()
    grads_plain = [p.grad.clone() for p in plain.parameters()]
    x_grad_plain = x.grad.clone()
    x.grad = None
    y_ckpt = ckpt(x)
    y_ckpt.square().sum().backward()
    # blocks [Linear, Tanh] and [Linear] have parameters; [_half, _half] has none
    assert ckpt._checkpointable_blocks() == [True, False, True] and calls == [1, 1]
    assert torch.equal(y_plain, y_ckpt) and torch.equal(x.grad, x_grad_plain)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads_plain, ckpt.parameters()))
    # checkpointable_layers: a block is eligible when all its classes are listed
    listed = PipelineModule(
        specs, num_stages=1, activation_checkpoint_interval=2, checkpointable_layers=["Linear", "Tanh"]
    )
    assert listed._checkpointable_blocks() == [True, False, True]
    listed.set_checkpoint_interval(1)
    assert listed._checkpointable_blocks() == [True, True, False, False, True]


def test_tuple_activations_pass_between_layers():
    class Split(nn.Module):
        def forward(self, x):
            return x, x * 2

    class Join(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(3.0))

        def forward(self, inputs):
            a, b = inputs
            return (a + b) * self.scale

    for interval in (0, 1):
        module = PipelineModule([Split(), Join()], num_stages=1, activation_checkpoint_interval=interval)
        x = torch.ones(2, requires_grad=True)
        assert torch.equal(module(x), torch.full((2,), 9.0))


def test_tied_layer_occurrences_share_one_module_on_one_stage():
    def head(embedding, x):
        return x @ embedding.weight.t()

    specs = [
        TiedLayerSpec("embed", nn.Embedding, 7, 4),
        LayerSpec(nn.Linear, 4, 4),
        TiedLayerSpec("embed", nn.Embedding, 7, 4, forward_fn=head),
    ]
    module = PipelineModule(specs, num_stages=1, seed_layers=True)
    assert list(module.state_dict()) == ["tied_modules.embed.weight", "1.weight", "1.bias"]
    assert module.forward_funcs[0] is module.tied_modules["embed"] and module.tied_comms == {}
    ids = torch.tensor([[1, 2, 3]])
    emb = module.tied_modules["embed"]
    expected = module.forward_funcs[1](emb(ids)) @ emb.weight.t()
    assert torch.equal(module(ids), expected)


def test_partition_methods_and_their_logs():
    import io
    import logging

    from zerotrain.log import logger

    specs = [LayerSpec(nn.Linear, 4, 4), nn.ReLU(), LayerSpec(nn.Linear, 4, 4)]
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        for method in ("parameters", "uniform", "type:linear", "TYPE:Lin.ar", "Uniform"):
            assert PipelineModule(specs, num_stages=1, partition_method=method).parts == [0, 3]
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "stage=0 layers=3" in out and "     1: ReLU" in out
    assert "Partitioning pipeline stages with method type:linear" in out


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({}, RuntimeError, "must provide num_stages or topology"),
        ({"num_stages": 2}, RuntimeError, "num_stages=2 does not divide the world size 1; choose"),
        ({"num_stages": 0}, ValueError, "num_stages must be a positive int"),
        (
            {"num_stages": 1, "partition_method": "balanced"},
            NotImplementedError,
            "partition_method='balanced' is not implemented; use one of parameters, uniform, type:<regex>",
        ),
        ({"num_stages": 1, "partition_method": "profile"}, NotImplementedError, "'profile' is not implemented"),
        ({"num_stages": 1, "partition_method": "type:conv"}, RuntimeError, "'type:conv' matches no layer class"),
        ({"topology": ProcessTopology(["data"], [1])}, ValueError, "no 'pipe' axis; use PipeDataParallelTopology"),
        ({"topology": PipeDataParallelTopology(2, 1)}, ValueError, "the topology has 2 ranks"),
        ({"num_stages": 2, "topology": PipeDataParallelTopology(1, 1)}, ValueError, "pass one of the two"),
        ({"num_stages": 1, "activation_checkpoint_interval": -1}, ValueError, "activation_checkpoint_interval"),
        ({"num_stages": 1, "checkpointable_layers": "Linear"}, TypeError, "checkpointable_layers must be a list"),
    ],
)
def test_errors_are_one_line_and_name_the_fix(kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        PipelineModule([LayerSpec(nn.Linear, 4, 4)], **kwargs)
    assert "\n" not in str(info.value)


def test_nested_pipeline_module_and_non_layers_are_refused():
    inner = PipelineModule([LayerSpec(nn.Linear, 4, 4)], num_stages=1)
    with pytest.raises(NotImplementedError, match="layer 1 is a PipelineModule; nesting them is not supported"):
        PipelineModule([nn.ReLU(), inner], num_stages=1)
    with pytest.raises(TypeError, match="layer 0 .* is not an nn.Module, a LayerSpec or a callable"):
        PipelineModule([3], num_stages=1)


def test_layer_files_round_trip_and_names(tmp_path):
    specs = _specs()
    module = PipelineModule(specs, num_stages=1, seed_layers=True)
    assert module.ckpt_layer_path(str(tmp_path), 2) == os.path.join(str(tmp_path), "layer_02-model_states.pt")
    assert module.ckpt_prefix("ckpts", "global_step3") == os.path.join("ckpts", "global_step3", "module-pipe_00")
    module.save_state_dict(str(tmp_path))
    # every module has a file (Tanh's and Dropout's are empty, as in DeepSpeed); the function has none
    assert sorted(os.listdir(tmp_path)) == [f"layer_0{i}-model_states.pt" for i in (0, 1, 2, 4, 5)]
    assert torch.load(tmp_path / "layer_01-model_states.pt", weights_only=True) == {}
    assert module.ckpt_layer_path_list(str(tmp_path), 5) == [str(tmp_path / "layer_05-model_states.pt")]
    state = torch.load(tmp_path / "layer_02-model_states.pt", weights_only=True)
    assert list(state) == ["weight", "bias"] and torch.equal(state["weight"], module.forward_funcs[2].weight)
    other = PipelineModule(specs, num_stages=1, seed_layers=True, base_seed=99)
    assert not torch.equal(other.forward_funcs[0].weight, module.forward_funcs[0].weight)
    other.load_state_dir(str(tmp_path))
    for a, b in zip(module.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    # frozen parameters can be left out; a missing file names the folder to pass
    module.forward_funcs[0].bias.requires_grad_(False)
    module.save_state_dict(str(tmp_path / "frozen"), exclude_frozen_params=True)
    assert list(torch.load(tmp_path / "frozen" / "layer_00-model_states.pt", weights_only=True)) == ["weight"]
    with pytest.raises(FileNotFoundError, match="no file layer_00-\\*model_states.pt in .*pass the checkpoint's tag"):
        other.load_state_dir(str(tmp_path / "missing"))


def test_layer_files_refuse_pickled_objects(tmp_path):
    module = PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=1)
    torch.save(
        {"weight": torch.zeros(2, 2), "bias": torch.zeros(2), "evil": _Pickled()}, tmp_path / "layer_00-model_states.pt"
    )
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        module.load_state_dir(str(tmp_path))


class _Pickled:
    pass
