"""What zerotrain's MoE layer keeps for backward (issue 32): besides what the experts themselves
save, only the routes' gathered expert-output rows (the gate's gradient needs them). The capacity
buffer and the combine must not keep extra [k * S, M] copies (index_copy and index_add save their
sources: the layer used both). Counted exactly with saved-tensor hooks, one process, no clock."""

from __future__ import annotations

import pytest
import torch
from torch import nn

S, H, E = 64, 32, 4


def _big_saved_storages(moe, x):
    """Bytes of each distinct floating-point storage of at least S * H elements saved for backward,
    parameters and the input (the gate's Linear saves it) excluded."""
    params = {p.untyped_storage().data_ptr() for p in moe.parameters()} | {x.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if t.is_floating_point() and storage.data_ptr() not in params and storage.nbytes() >= S * H * t.element_size():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, l_aux, counts = moe(x)
    (out.square().mean() + l_aux).backward()  # the graph is whole
    return sorted(saved.values()), counts


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_layer_saves_only_expert_inputs_and_routed_rows(k, drop_tokens):
    from zerotrain.moe.layer import MoE

    torch.manual_seed(0)
    moe = MoE(
        H,
        nn.Linear(H, H),
        num_experts=E,
        k=k,
        capacity_factor=1.25,
        min_capacity=4,
        drop_tokens=drop_tokens,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    x = torch.randn(S, H, requires_grad=True)
    sizes, counts = _big_saved_storages(moe, x)
    cap = moe.deepspeed_moe.capacity
    # each expert's Linear saves its input: the capacity buffer [E, C, M], or dropless the routed
    # tokens grouped by expert; the combine saves the gathered rows [k, S, M] for the gate's gradient
    expert_inputs = E * cap * H * 4 if drop_tokens else int(counts.sum()) * H * 4
    assert sizes == sorted([expert_inputs, k * S * H * 4])
