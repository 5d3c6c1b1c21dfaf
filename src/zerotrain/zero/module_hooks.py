"""Which modules stage 3's ``ParameterCoordinator`` (zero/stage3.py) follows, and its hooks on them.

Every module whose own forward uses partitioned units gets a forward pre-hook and a forward hook
(removable: DeepSpeed's ``forward_hooks``, which RL trainers take off around generation); modules
inside a leaf (zero/leaves.py) are left to the leaf's hooks. Every module holding such parameters
has its ``_parameters`` dict replaced by one that reports each read, so parameters used outside
their own module (tied weights, ``other.weight`` in a forward) are gathered where they are read.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from zerotrain.zero.leaves import unit_parameters
from zerotrain.zero.partition import FlatParamUnit
from zerotrain.zero.passes import unique


class _GatheringParameters(dict):
    """A module's ``_parameters`` that reports every parameter read (the coordinator gathers a
    partitioned one when it is read in a forward)."""

    def __init__(self, on_access: Callable[[nn.Parameter], None], params: dict):
        super().__init__(params)
        self._on_access = on_access

    def __getitem__(self, name):
        param = super().__getitem__(name)
        if param is not None:
            self._on_access(param)
        return param


class ModuleHooks:
    """The modules of ``module``'s tree the coordinator follows, the units each one's own forward
    uses (``module_units``), and the forward hooks on them."""

    def __init__(
        self,
        module: nn.Module,
        unit_of: dict[int, FlatParamUnit],
        leaf_of: dict,
        on_access: Callable[[nn.Parameter], None],
    ):
        self.handles: list = []  # the forward hooks of register(), removable
        self.module_units: dict[nn.Module, list[FlatParamUnit]] = {}
        self._hooked: list[nn.Module] = []  # every module whose forward the hooks follow
        self._wrapped: list[nn.Module] = []  # modules whose _parameters gather on access
        for m in module.modules():
            if any(id(p) in unit_of for p in m._parameters.values() if p is not None):
                m._parameters = _GatheringParameters(on_access, m._parameters)
                self._wrapped.append(m)
            params = unit_parameters(m, leaf_of)
            if params is None:
                continue  # inside a leaf: the leaf's hooks gather and release its whole subtree
            own = unique(unit_of.get(id(p)) for p in params)
            if own:
                self.module_units[m] = own
            self._hooked.append(m)

    def register(self, pre_forward: Callable, post_forward: Callable) -> None:
        """Hook every followed module's forward, once: handles still registered are replaced."""
        self.remove()
        for m in self._hooked:
            self.handles.append(m.register_forward_pre_hook(pre_forward))
            self.handles.append(m.register_forward_hook(post_forward, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def unwrap_parameters(self) -> None:
        """Give each module its plain ``_parameters`` dict back."""
        for m in self._wrapped:
            if isinstance(m._parameters, _GatheringParameters):
                m._parameters = dict(m._parameters)
