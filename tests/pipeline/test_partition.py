"""DeepSpeed's stage boundaries (``deepspeed.runtime.utils.partition_uniform`` /
``partition_balanced``), and the layer specs.

The expected ``parts`` were produced by DeepSpeed 0.19.8's own two functions on these inputs and
are written here as literals. ``partition_balanced`` is a dynamic program: for ``i`` items in
``j`` parts it keeps the split point ``k`` with the lowest ``max - min`` of part sums (the max
and min extending the kept split of ``k`` items into ``j - 1`` parts), the largest ``k`` among
equal costs. Every case below reaches the brute-force minimum of ``max - min`` (checked), and
the cases with several optimal splits pin the tie-breaking.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from zerotrain.pipeline import LayerSpec, TiedLayerSpec, partition_balanced, partition_uniform
from zerotrain.pipeline.tied import _recursive_getattr

UNIFORM = [  # (items, parts, DeepSpeed's parts)
    (10, 3, [0, 4, 7, 10]),
    (9, 3, [0, 3, 6, 9]),
    (2, 4, [0, 1, 2, 2, 2]),
    (4, 4, [0, 1, 2, 3, 4]),
    (0, 2, [0, 0, 0]),
    (7, 1, [0, 7]),
    (5, 2, [0, 3, 5]),
    (11, 4, [0, 3, 6, 9, 11]),
    (3, 2, [0, 2, 3]),
]

# DeepSpeedExamples' AlexNet-like CIFAR pipeline: trainable parameters per layer.
ALEXNET = [304, 0, 0, 1229056, 0, 0, 885120, 0, 0, 663936, 0, 442624, 0, 0, 0, 37752832, 0, 16781312, 0, 40970]

BALANCED = [  # (weights, parts, DeepSpeed's parts)
    ([1] * 8, 2, [0, 4, 8]),
    ([1] * 8, 3, [0, 3, 6, 8]),  # tie: 3/3/2 beats 2/3/3 (largest k)
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [0, 5, 7, 9]),
    ([5, 1, 1, 1, 1, 5], 2, [0, 3, 6]),
    ([0, 0, 1, 0, 0, 1, 0, 0], 2, [0, 5, 8]),  # type:<regex> weights; tie among 3..5
    ([1, 1, 1, 1], 3, [0, 2, 3, 4]),
    ([2, 2, 2], 2, [0, 2, 3]),
    ([3, 1, 1, 1, 3], 3, [0, 1, 4, 5]),
    ([0, 0, 0, 0], 2, [0, 3, 4]),  # all splits tie: the last one
    ([10, 0, 0, 10], 2, [0, 3, 4]),
    ([1, 100, 1, 1, 1, 100, 1], 3, [0, 2, 5, 7]),
    ([4, 5], 3, [0, 1, 2, 2]),  # fewer items than parts: uniform
    ([0, 1, 1, 1, 1, 0], 2, [0, 3, 6]),
    ([0, 1, 1, 1, 1, 1, 1, 0], 4, [0, 3, 5, 6, 8]),
    ([7, 2, 5, 10, 8], 2, [0, 3, 5]),
    ([1, 3, 2, 4, 2, 3, 1], 3, [0, 3, 5, 7]),
    (ALEXNET, 2, [0, 17, 20]),
    (ALEXNET, 4, [0, 6, 15, 17, 20]),
    ([9, 1, 1, 1, 1, 1, 1, 1, 1, 9], 3, [0, 1, 9, 10]),
    ([1, 2, 3, 4, 5, 6], 6, [0, 1, 2, 3, 4, 5, 6]),
    ([6, 5, 4, 3, 2, 1], 4, [0, 1, 2, 3, 6]),
    ([1] * 10, 4, [0, 3, 6, 8, 10]),
    ([3, 3, 1, 1, 1, 1], 3, [0, 1, 3, 6]),
    ([2, 1, 1, 2], 2, [0, 2, 4]),
]


def _cost(weights, parts) -> float:
    sums = [sum(weights[parts[i] : parts[i + 1]]) for i in range(len(parts) - 1)]
    return max(sums) - min(sums)


def _brute_force_min_cost(weights, num_parts) -> float:
    n = len(weights)
    return min(_cost(weights, [0, *cuts, n]) for cuts in itertools.combinations(range(1, n), num_parts - 1))


@pytest.mark.parametrize("items,parts,expected", UNIFORM)
def test_partition_uniform_matches_deepspeed(items, parts, expected):
    assert partition_uniform(items, parts) == expected


@pytest.mark.parametrize("weights,parts,expected", BALANCED)
def test_partition_balanced_matches_deepspeed(weights, parts, expected):
    got = partition_balanced(weights, parts)
    assert got == expected
    assert all(isinstance(b, int) for b in got)
    if len(weights) > parts:
        assert all(got[i] < got[i + 1] for i in range(parts))  # no empty stage
        assert _cost(weights, got) == _brute_force_min_cost(weights, parts)


def test_partition_rejects_no_parts():
    with pytest.raises(ValueError, match="num_parts must be >= 1"):
        partition_uniform(3, 0)
    with pytest.raises(ValueError, match="num_parts must be >= 1"):
        partition_balanced([1, 2], 0)


class _Wrapped(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.linear = torch.nn.Linear(n, n)


def test_layer_spec_forms():
    spec = LayerSpec(torch.nn.Linear, 4, 8, bias=False)
    assert repr(spec) == "Linear(4, 8, bias=False)"
    built = spec.build()
    assert isinstance(built, torch.nn.Linear) and built.bias is None and built.weight.shape == (8, 4)
    # The process's global rank; -1 without a process group (an earlier test in this process may
    # have left one: then its rank).
    assert spec.global_rank == (torch.distributed.get_rank() if torch.distributed.is_initialized() else -1)
    with pytest.raises(RuntimeError, match="torch.nn.Module"):
        LayerSpec(lambda x: x)
    # tied_weight_attr: a name, a list, a dotted path
    assert TiedLayerSpec("e", torch.nn.Embedding, 5, 3).tied_weight_attr == ["weight"]
    assert TiedLayerSpec("e", torch.nn.Embedding, 5, 3, tied_weight_attr="weight").tied_weight_attr == ["weight"]
    both = TiedLayerSpec("l", torch.nn.Linear, 3, 3, tied_weight_attr=["weight", "bias"])
    assert both.tied_weight_attr == ["weight", "bias"] and both.forward_fn is None and both.key == "l"
    dotted = TiedLayerSpec("w", _Wrapped, 3, tied_weight_attr="linear.weight", forward_fn=len)
    module = dotted.build()
    assert dotted.forward_fn is len
    assert _recursive_getattr(module, dotted.tied_weight_attr[0]) is module.linear.weight
