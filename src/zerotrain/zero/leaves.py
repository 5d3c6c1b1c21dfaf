"""Stage-3 leaf modules: a module whose whole subtree is one unit, gathered and released at once.

By default stage 3 makes one unit per module (its own parameters), gathered by hooks on that
module. A transformer block of 6 small modules then costs 6 gathers, 12 hooks and 6 gradient
reductions a pass: on small models and fast devices that host work, not the arithmetic, sets
the step time. A leaf module's subtree is one unit instead, with hooks on the leaf alone.
The price is memory: the whole leaf is gathered while any part of it runs.

Any of these makes a leaf:

- ``set_z3_leaf_modules(model, [BlockClass or "BlockClass"])`` (DeepSpeed's
  ``deepspeed.utils.set_z3_leaf_modules``), which flags module instances;
- the config's ``zero_optimization.leaf_module`` (``classes``, ``names``, ``name_suffixes``);
  without that section, DeepSpeed's default MoE block classes and, when training on an
  accelerator, the classes a Hugging Face model lists in ``_no_split_modules`` (its transformer
  block: what FSDP users wrap). On a GPU the per-module host work set stage 3's step time (110M
  GPT-2 on an H200: 60 -> 37 ms a step with block leaves); on the CPU the arithmetic does for
  large blocks (17M/110M GPT-2: leaves changed the step time within noise and added 20-100 MiB
  of peak RSS), so the CPU makes leaves of small blocks only (:func:`small_blocks`). An
  explicit section, even an empty one, replaces the default;
- ``stage3_module_granularity_threshold``: outermost modules whose parameters per module of the
  subtree (DeepSpeed's granularity) are at most the threshold.

A leaf nested inside another leaf is part of the outer one.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from zerotrain.accelerator import get_accelerator
from zerotrain.log import log_rank0
from zerotrain.memory_release import MMAP_THRESHOLD_BYTES

LEAF_FLAG = "_z3_leaf"  # DeepSpeed's attribute name: models flagged for DeepSpeed work unchanged
# Larger leaves keep too much whole at once (DeepSpeed's cap).
MAX_LEAF_NUMEL = 10**9
# DeepSpeed's default ``leaf_module.classes``: MoE blocks, whose experts run in a data-dependent
# order that per-module prefetching cannot follow.
DEEPSPEED_DEFAULT_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
# zerotrain's own: the local experts of its MoE layer (``zerotrain.moe.layer.MoE``) are one unit,
# gathered once over their expert-data group per layer call (every rank runs every local expert).
ZEROTRAIN_DEFAULT_CLASSES = ("zerotrain.experts.layer.Experts",)
# On the CPU, ``_no_split_modules`` blocks with parameters up to this size are default leaves
# (:func:`small_blocks`): glibc's mmap threshold under memory_release "eager", below which a
# gather buffer comes from the heap.
SMALL_BLOCK_BYTES = MMAP_THRESHOLD_BYTES


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is flagged as a leaf."""
    return bool(getattr(module, LEAF_FLAG, False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _class_matches(module: nn.Module, wanted) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _check_classes(classes) -> None:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be classes or class names, got {bad!r}")


def modules_of_classes(model: nn.Module, classes: Iterable) -> list[nn.Module]:
    classes = list(classes)
    _check_classes(classes)
    return [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]


def _flag(modules: list[nn.Module], flag: bool) -> list[nn.Module]:
    for m in modules:
        setattr(m, LEAF_FLAG, flag)
    return modules


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of ``model`` that is an instance of one of ``leaf_module_classes``
    (classes, or names: ``"GPT2Block"`` or ``"transformers.models.gpt2.modeling_gpt2.GPT2Block"``)
    as a stage-3 leaf; returns them. Call before ``zerotrain.initialize``."""
    found = modules_of_classes(model, leaf_module_classes)
    if not found and raise_if_not_found:
        raise ValueError(
            f"no module of {list(leaf_module_classes)!r} in the model: "
            "name a class the model uses (see model.named_modules())"
        )
    return _flag(found, True)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clear the leaf flag of the modules of ``leaf_module_classes``; returns them."""
    found = modules_of_classes(model, leaf_module_classes)
    if not found and raise_if_not_found:
        raise ValueError(f"no module of {list(leaf_module_classes)!r} in the model")
    return _flag(found, False)


def _by_names(model: nn.Module, names: Iterable[str], suffix: bool) -> tuple[list[nn.Module], list[str]]:
    named = list(model.named_modules())
    found, missing = [], []
    for wanted in names:
        hits = [m for n, m in named if (n.endswith(wanted) if suffix else n == wanted)]
        if not hits:
            missing.append(wanted)
        found += hits
    return list(dict.fromkeys(found)), missing


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: list[str], flag: bool = True, raise_if_not_found: bool = True
):
    """Flag (or with ``flag=False`` clear) the modules named ``module_names`` (as in
    ``named_modules()``); returns ``(modules, names not found)``."""
    found, missing = _by_names(model, module_names, suffix=False)
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing} in the model")
    return _flag(found, flag), missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: list[str], flag: bool = True, raise_if_not_found: bool = True
):
    """Flag (or clear) the modules whose ``named_modules()`` name ends with one of the suffixes;
    returns ``(modules, suffixes that matched nothing)``."""
    found, missing = _by_names(model, module_name_suffixes, suffix=True)
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {missing} in the model")
    return _flag(found, flag), missing


def granularity_leaves(model: nn.Module, threshold: int) -> list[nn.Module]:
    """DeepSpeed's ``stage3_module_granularity_threshold``: from the root down, the first module
    on each path whose granularity (parameters of its subtree per module of the subtree, modules
    without children or parameters not counted as candidates) is at most ``threshold``.
    Containers (ModuleList, Sequential, ...) are never leaves: they may not run a forward."""
    granularity: dict[nn.Module, int] = {}

    def numel(p) -> int:
        return int(getattr(p, "ds_numel", None) or p.numel())

    def walk(module: nn.Module) -> tuple[int, int]:  # (modules counted, parameters) of the subtree
        own = sum(numel(p) for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            return (1, own) if own else (0, 0)
        layers, params = 0, own
        for child in children:
            child_layers, child_params = walk(child)
            layers, params = layers + child_layers, params + child_params
        if params == 0 or type(module).__name__ in nn.modules.container.__all__:
            return layers, params
        layers += 1
        if params <= MAX_LEAF_NUMEL:
            granularity[module] = params // layers
        return layers, params

    walk(model)
    leaves: list[nn.Module] = []

    def choose(module: nn.Module) -> None:
        if module in granularity and granularity[module] <= threshold:
            leaves.append(module)
            return
        for child in module.children():
            choose(child)

    choose(model)
    if not leaves and granularity:
        smallest = min(granularity.items(), key=lambda kv: kv[1])
        log_rank0(
            f"stage3_module_granularity_threshold {threshold} selects no module: the "
            f"smallest granularity is {smallest[1]} ({type(smallest[0]).__name__}); set the "
            f"threshold at least that high to gather such modules whole"
        )
    return leaves


def no_split_classes(model: nn.Module) -> list[str]:
    """The block classes a Hugging Face model lists in ``_no_split_modules``."""
    no_split = getattr(model, "_no_split_modules", None) or []
    if isinstance(no_split, str):
        no_split = [no_split]
    return [c for c in no_split if isinstance(c, str)]


def default_leaf_classes(model: nn.Module, on_accelerator: bool) -> list[str]:
    """zerotrain's leaf classes when the config has no ``leaf_module`` section: DeepSpeed's MoE
    blocks, the local experts of zerotrain's MoE layer, and on an accelerator the model's
    ``_no_split_modules`` (Hugging Face: the transformer block; on the CPU see
    :func:`small_blocks`)."""
    no_split = no_split_classes(model) if on_accelerator else []
    return [*no_split, *DEEPSPEED_DEFAULT_CLASSES, *ZEROTRAIN_DEFAULT_CLASSES]


def _nbytes(module: nn.Module) -> int:
    return sum(int(getattr(p, "ds_numel", None) or p.numel()) * p.dtype.itemsize for p in module.parameters())


def small_blocks(model: nn.Module) -> list[nn.Module]:
    """The CPU's default leaves among the ``_no_split_modules`` blocks: those whose parameters
    take at most ``SMALL_BLOCK_BYTES``. Each gather and reduction is a rendezvous of the ranks'
    processes; a block of small modules cost six of each where the arithmetic is small (issue
    33's host-bound GPT-2: 148 gathers and 147 reductions a step per-module, 27 of each with
    block leaves). Large blocks stay per-module: gathered whole they raised the peak RSS by up to
    100 MiB at 110M GPT-2 (28 MiB blocks) for no measurable time."""
    blocks = modules_of_classes(model, no_split_classes(model))
    return [m for m in blocks if _nbytes(m) <= SMALL_BLOCK_BYTES]


def leaf_modules(model: nn.Module, zero_config=None) -> list[nn.Module]:
    """The leaves of ``model`` for a stage-3 engine: flagged modules, and those the config's
    ``leaf_module`` section (or without one, :func:`default_leaf_classes`) and
    ``module_granularity_threshold`` select (not flagged: the config's choice lasts as long as
    the engine)."""
    leaves = get_z3_leaf_modules(model)
    if zero_config is not None:
        section = zero_config.leaf_module
        if "leaf_module" in zero_config.model_fields_set:
            classes = section.classes
        else:
            on_accelerator = get_accelerator().name != "cpu"
            classes = default_leaf_classes(model, on_accelerator)
            if not on_accelerator:
                leaves += small_blocks(model)
        leaves += modules_of_classes(model, classes)
        found, missing = _by_names(model, section.names, suffix=False)
        leaves += found
        if missing:
            log_rank0(f"zero_optimization.leaf_module.names: no module named {missing}")
        found, missing = _by_names(model, section.name_suffixes, suffix=True)
        leaves += found
        if missing:
            log_rank0(f"zero_optimization.leaf_module.name_suffixes: no module name ends with {missing}")
        if zero_config.module_granularity_threshold > 0:
            leaves += granularity_leaves(model, int(zero_config.module_granularity_threshold))
    return list(dict.fromkeys(leaves))  # modules hash by identity: duplicates go, order stays


def leaf_of(model: nn.Module, leaves: Iterable[nn.Module]) -> dict[nn.Module, nn.Module]:
    """Every module inside a leaf (the leaf itself included) -> its outermost leaf."""
    leaves = set(leaves)
    out: dict[nn.Module, nn.Module] = {}
    if not leaves:
        return out

    def walk(module: nn.Module, leaf: nn.Module | None) -> None:
        if leaf is None and module in leaves:
            leaf = module
        if leaf is not None:
            out.setdefault(module, leaf)
        for child in module.children():
            walk(child, leaf)

    walk(model, None)
    return out


def unit_parameters(module: nn.Module, leaf_of: dict[nn.Module, nn.Module]):
    """The parameters ``module``'s stage-3 units take: its own, a leaf's whole subtree; None for
    a module inside a leaf (the leaf's units hold them)."""
    leaf = leaf_of.get(module)
    if leaf is None:
        return [p for p in module._parameters.values() if p is not None]
    return list(module.parameters()) if leaf is module else None


__all__ = [
    "z3_leaf_module",
    "get_z3_leaf_modules",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "granularity_leaves",
    "leaf_modules",
    "leaf_of",
    "unit_parameters",
]
