"""A save-and-resume round the expert checkpoint tests share (test_expert_checkpoint.py, zerotrain's
MoE layer; test_hf_expert_checkpoint.py, expert-parallel Hugging Face experts): save, train on,
load into a fresh engine, train the same steps again, and what to compare."""

from __future__ import annotations

from collections.abc import Callable

import torch


def optimizer_state(engine) -> list:
    """Every stepped tensor (fp32 master or shard) and its optimizer state, in group order."""
    opt = engine.optimizer
    return [
        (p.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()})
        for group in opt.param_groups
        for p in group["params"]
    ]


def same_state(a: list, b: list) -> bool:
    """``optimizer_state`` lists equal to the bit."""
    if len(a) != len(b):
        return False
    for (pa, sa), (pb, sb) in zip(a, b):
        if not torch.equal(pa, pb) or sa.keys() != sb.keys():
            return False
        if any(not torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa):
            return False
    return True


def save_and_resume(
    engine, path: str, tag: str, weights: Callable, train_on: Callable, build_fresh: Callable, async_save: bool = False
) -> dict:
    """Save ``engine`` (already trained up to the save) under ``path``/``tag``, go on with
    ``train_on(engine)`` (the losses: the reference), then load ``path`` into ``build_fresh()``
    and run ``train_on`` there too. ``weights(engine)`` is what is compared (a collective where
    the caller's is: every rank runs this in the same order). Destroys both engines. Returns
    ``saved``/``final``/``resumed`` weights, ``ref_losses``/``losses``, whether the load gave
    back the saved weights (``loaded_equal``) and optimizer state (``state_equal``), and the
    resumed engine's ``step``."""
    engine.save_checkpoint(path, tag=tag, async_save=async_save)
    saved, state = weights(engine), optimizer_state(engine)
    ref_losses = train_on(engine)
    if async_save:
        engine.wait_for_checkpoint()
    final = weights(engine)
    engine.destroy()
    fresh = build_fresh()
    fresh.load_checkpoint(path)
    loaded, loaded_state = weights(fresh), optimizer_state(fresh)
    losses = train_on(fresh)
    out = {
        "saved": saved,
        "final": final,
        "ref_losses": ref_losses,
        "losses": losses,
        "loaded_equal": all(torch.equal(loaded[k], v) for k, v in saved.items()),
        "state_equal": same_state(state, loaded_state),
        "resumed": weights(fresh),
        "step": fresh.global_steps,
    }
    fresh.destroy()
    return out
