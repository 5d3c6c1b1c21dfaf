"""DeepSpeed's stage-3 hook handles, as frameworks reach them around generation.

RL trainers (TRL's GRPO/RLOO/online DPO, OpenRLHF) generate with a ZeRO-3 model by gathering every
parameter (``GatheredParameters(model.parameters())``), removing the stage's forward hooks so the
many small forwards of ``generate`` gather nothing, and putting them back afterwards. They reach
DeepSpeed's ``engine.optimizer.parameter_offload`` for that: its ``module``, ``forward_hooks`` and
``backward_hooks`` (handles they ``remove()`` and then empty), ``param_coordinator``
(``is_invalid_trace()``, ``_invalidate_trace()``) and ``_register_deepspeed_module(module)``, and
each parameter's ``ds_active_sub_modules`` and each module's ``ds_external_parameters()``.

``ParameterOffload`` is that surface over zerotrain's ``ParameterCoordinator``: the hooks it hands
out are the coordinator's own forward hooks. zerotrain registers no per-module backward hooks
(a forward hooks its outputs' backward each time), so ``backward_hooks`` is empty: removing the
forward hooks is what stops a forward from gathering. The engine attaches it to its optimizer at
stage 3 and removes it at ``destroy()``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

ATTRIBUTE = "parameter_offload"
MODULE_METHOD = "ds_external_parameters"

# module -> {id(parameter): parameter} registered with register_external_parameter.
_external = WeakIdKeyDictionary()


class TraceControl:
    """DeepSpeed's ``param_coordinator`` as frameworks call it: whether the recorded order of
    gathers (which prefetching follows) is invalid, and forgetting it."""

    def __init__(self, coordinator):
        self._coordinator = coordinator

    def is_invalid_trace(self) -> bool:
        return not self._coordinator.trace_recorded

    def _invalidate_trace(self) -> None:
        self._coordinator.invalidate_trace()


class ParameterOffload:
    """DeepSpeed's ``optimizer.parameter_offload`` over a stage-3 ``ParameterCoordinator``."""

    def __init__(self, coordinator, module: nn.Module):
        self.module = module
        self.param_coordinator = TraceControl(coordinator)
        self._coordinator = coordinator
        self._backward_hooks: list = []

    @property
    def forward_hooks(self) -> list:
        """The handles of the forward hooks that gather and release (``remove()`` each to stop)."""
        return self._coordinator.hook_handles

    @forward_hooks.setter
    def forward_hooks(self, handles: list) -> None:
        self._coordinator.hook_handles = list(handles)

    @property
    def backward_hooks(self) -> list:
        """Always empty here: each forward hooks its own outputs' backward."""
        return self._backward_hooks

    @backward_hooks.setter
    def backward_hooks(self, handles: list) -> None:
        self._backward_hooks = list(handles)

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Put the forward hooks back (DeepSpeed's name); only the engine's module has them."""
        if module is not self.module:
            raise ValueError(
                "_register_deepspeed_module: zerotrain hooks the engine's own module only; "
                "pass engine.optimizer.parameter_offload.module"
            )
        self._coordinator.register_hooks()


def attach(optimizer, coordinator, module: nn.Module) -> None:
    """``optimizer.parameter_offload`` and each module's ``ds_external_parameters()``."""
    if optimizer is not None:
        setattr(optimizer, ATTRIBUTE, ParameterOffload(coordinator, module))
    for m in module.modules():
        vars(m)[MODULE_METHOD] = functools.partial(external_parameters, m)


def detach(optimizer, module: nn.Module) -> None:
    """Remove what ``attach`` added (``destroy()``)."""
    if optimizer is not None and isinstance(vars(optimizer).get(ATTRIBUTE), ParameterOffload):
        delattr(optimizer, ATTRIBUTE)
    for m in module.modules():
        vars(m).pop(MODULE_METHOD, None)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's ``zero.register_external_parameter``: ``module``'s forward uses ``parameter``,
    which another module owns. zerotrain gathers a parameter wherever a forward reads it, so this
    only records it for ``module.ds_external_parameters()``."""
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter: expected an nn.Parameter, got {type(parameter).__name__}")
    _external.setdefault(module, {})[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's ``zero.unregister_external_parameter``."""
    registered = _external.get(module, {})
    if id(parameter) not in registered:
        raise ValueError("unregister_external_parameter: the parameter was not registered with this module")
    del registered[id(parameter)]


def external_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the parameters registered as used by ``module``."""
    return [(str(key), p) for key, p in _external.get(module, {}).items()]


class ActiveSubModules:
    """A parameter's ``ds_active_sub_modules``: the ids of the modules whose forward is running
    and uses its unit (empty between passes). ``clear()`` forgets those uses, so the unit is not
    kept for them."""

    def __init__(self, unit):
        self._unit = unit

    def _entries(self) -> Iterator[tuple[nn.Module, set]]:
        coordinator = self._unit.coordinator
        for module, used in coordinator.forward_stack if coordinator is not None else ():
            if self._unit in used:
                yield module, used

    def __iter__(self):
        return iter([id(module) for module, _ in self._entries()])

    def __len__(self) -> int:
        return sum(1 for _ in self._entries())

    def __contains__(self, module_id) -> bool:
        return any(id(module) == module_id for module, _ in self._entries())

    def clear(self) -> None:
        for _, used in list(self._entries()):
            used.discard(self._unit)

    def __repr__(self) -> str:
        return f"ActiveSubModules({set(self)})"
