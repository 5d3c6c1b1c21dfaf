"""Prints the expected values of test_gating.py's DeepSpeed cases, computed by DeepSpeed itself:

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/experts/deepspeed_gating_cases.py \
        > tests/experts/deepspeed_gating_expected.py

(DeepSpeed 0.19.8, torch 2.13.0 CPU). Each case: fixed logits (two decimals, so the literal is the
tensor), the gate function and its arguments, and, where the gate draws random numbers (random
token selection, RSample, top-2's second-expert sampling), the torch seed set just before the call.
Output: capacity, l_aux, exp_counts, the non-zero combine weights (token, expert, slot, weight)
and the dispatch mask's true entries, as a Python module that test_gating.py imports. Runs
without zerotrain.
"""

import pprint
import random
import textwrap

import torch

# name: (gate, S, E, kwargs, seed before the call or None)
CASES = {
    # seed 12: random token selection keeps other tokens than use_rts=False would
    "top1_rts_drops": ("top1", 12, 4, dict(capacity_factor=1.0, min_capacity=0, use_rts=True), 12),
    "top1_rsample_rts": (
        "top1",
        12,
        4,
        dict(capacity_factor=0.5, min_capacity=2, use_rts=True, noisy_gate_policy="RSample"),
        12,
    ),
    "top1_used_token": (
        "top1",
        10,
        3,
        dict(capacity_factor=2.0, min_capacity=1, use_rts=False, used_token=[1, 1, 0, 1, 1, 1, 0, 1, 1, 1]),
        None,
    ),
    "top1_dropless": ("top1", 12, 4, dict(capacity_factor=0.5, min_capacity=0, use_rts=False, drop_tokens=False), None),
    "top2_drops": ("top2", 12, 4, dict(capacity_factor=0.5, min_capacity=0, top2_2nd_expert_sampling=False), None),
    "top2_sampling": ("top2", 12, 4, dict(capacity_factor=1.0, min_capacity=0, top2_2nd_expert_sampling=True), 21),
    "top2_dropless": (
        "top2",
        12,
        4,
        dict(capacity_factor=0.5, min_capacity=0, top2_2nd_expert_sampling=False, drop_tokens=False),
        None,
    ),
    "top3_probs_drops": ("topk", 12, 5, dict(k=3, capacity_factor=0.5, min_capacity=0, drop_policy="probs"), None),
    "top3_position_drops": (
        "topk",
        12,
        5,
        dict(k=3, capacity_factor=0.5, min_capacity=0, drop_policy="position"),
        None,
    ),
    "top3_dropless": ("topk", 12, 5, dict(k=3, capacity_factor=0.5, min_capacity=0, drop_tokens=False), None),
}


def logits_of(name: str, S: int, E: int) -> list:
    rng = random.Random(name)
    return [[round(rng.gauss(0.0, 2.0), 2) for _ in range(E)] for _ in range(S)]


def main() -> None:
    from deepspeed.moe.sharded_moe import top1gating, top2gating, topkgating

    gates = {"top1": top1gating, "top2": top2gating, "topk": topkgating}
    print('"""What DeepSpeed 0.19.8 (torch 2.13.0 CPU) returned for deepspeed_gating_cases.py\'s cases;')
    print('written by that file (its docstring has the command): do not edit by hand."""')
    print()
    print("DEEPSPEED_CASES = {")
    for name, (gate, S, E, kwargs, seed) in CASES.items():
        kwargs = dict(kwargs)
        if "used_token" in kwargs:
            kwargs["used_token"] = torch.tensor(kwargs["used_token"])
        if seed is not None:
            torch.manual_seed(seed)
        l_aux, combine, dispatch, counts = gates[gate](torch.tensor(logits_of(name, S, E)), **kwargs)
        weights = [(s, e, c, round(float(combine[s, e, c]), 7)) for s, e, c in combine.nonzero().tolist()]
        print(f"    {name!r}: dict(capacity={combine.shape[2]}, l_aux={float(l_aux)!r}, exp_counts={counts.tolist()},")
        print("        combine=" + textwrap.indent(pprint.pformat(weights, width=100), " " * 16).lstrip() + ",")
        print(
            "        dispatch="
            + textwrap.indent(pprint.pformat(dispatch.nonzero().tolist(), width=100), " " * 17).lstrip()
            + "),"
        )
    print("}")


if __name__ == "__main__":
    main()
