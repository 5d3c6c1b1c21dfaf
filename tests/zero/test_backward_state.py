"""Which engines are in backward (zero/gradient_buckets.py): each gradient set owns its flag; a
gradient reaching one set's parameters outside its backward is kept only while another set's
backward is under way (a GAN), and a set closed mid-backward (engine.destroy()) stops counting."""

from __future__ import annotations

import pytest
import torch

from zerotrain.zero.gradient_buckets import BucketedGradients


def _gradients():
    param = torch.nn.Parameter(torch.ones(3))
    launched = []
    grads = BucketedGradients([[param]], launch=lambda bucket: launched.append(bucket) or None)
    return param, grads, launched


def test_kept_during_another_sets_backward_refused_after_it_is_closed():
    param_a, grads_a, _ = _gradients()
    param_b, grads_b, launched_b = _gradients()

    grads_b.begin_backward(sync=True)  # B's backward reaches A's parameter too (a GAN)
    (2 * param_a.sum() + 3 * param_b.sum()).backward()
    grads_b.end_backward()
    assert torch.equal(param_a.grad, torch.full((3,), 2.0))  # kept in A's buffer
    assert torch.equal(param_b.grad, torch.full((3,), 3.0)) and len(launched_b) == 1

    with pytest.raises(RuntimeError, match="outside engine.backward"):
        param_a.sum().backward()  # nobody in backward: refused

    grads_b.begin_backward(sync=True)  # B never ends this backward, then is closed
    grads_b.remove_hooks()
    with pytest.raises(RuntimeError, match="outside engine.backward"):
        param_a.sum().backward()
