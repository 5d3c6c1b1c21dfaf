"""``zero.Init``'s torch-function mode: while an ``Init`` context is active it catches any torch
function, method or property that receives a placeholder (an ``Init``-partitioned parameter) and
has the context gather that parameter whole first. Shape queries and attributes that do not depend
on the values are answered without gathering, and calls from zerotrain's runtime pass through
(see zero/init.py's module docstring for the whole scheme)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zerotrain.zero.partitioned_param import _LAYOUT, _SHARD, own_code

if TYPE_CHECKING:
    from types import FrameType

    from zerotrain.zero.init import Init

# Typed Any: torch's stubs declare Tensor's C getset descriptors as plain attributes, so mypy
# sees no __get__/__set__ on them; at runtime they are descriptors, as the mode receives them.
_T: Any = torch.Tensor
# Answers that are the same for a placeholder and the whole parameter: no gather.
_VALUE_FREE = {
    _T.dtype.__get__,
    _T.device.__get__,
    _T.layout.__get__,
    _T.requires_grad.__get__,
    _T.requires_grad.__set__,
    _T.requires_grad_,
    _T.grad_fn.__get__,
    _T.is_leaf.__get__,
    _T.grad.__get__,
    _T.retains_grad.__get__,
    _T.is_cuda.__get__,
    _T.is_cpu.__get__,
    _T.is_meta.__get__,
    _T.is_sparse.__get__,
    _T.is_quantized.__get__,
    _T.is_floating_point,
    _T.is_complex,
    _T.element_size,
    _T.get_device,
    _T._is_view,
    _T.register_hook,
    _T.register_post_accumulate_grad_hook,
    _T.__repr__,
}
# Shape queries: answered from the placeholder's recorded shape, no gather.
_SHAPE_QUERIES = {
    _T.shape.__get__,
    _T.size,
    _T.dim,
    _T.ndimension,
    _T.ndim.__get__,
    _T.numel,
    _T.nelement,
    _T.__len__,
    torch.numel,
}


def _find_placeholders(args, kwargs) -> list[nn.Parameter]:
    found: list = []

    def visit(x):
        if isinstance(x, torch.Tensor):
            if hasattr(x, _SHARD) and all(x is not f for f in found):
                found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)

    visit(args)
    visit(kwargs)
    return found


def _answer_shape_query(func, args, kwargs):
    """The shape query's answer from the recorded shape, or NotImplemented if unusual."""
    shape = getattr(args[0], _LAYOUT).slots[0].shape
    if func in (_T.dim, _T.ndimension, _T.ndim.__get__):
        return len(shape)
    if func in (_T.numel, _T.nelement, torch.numel):
        return shape.numel()
    if func is _T.__len__:
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:
        return torch.Size(shape)
    return shape[dim] if isinstance(dim, int) else NotImplemented


# zerotrain's runtime packages: they handle placeholders themselves and build no user model.
# (Packages that build models for the user, such as zerotrain.models, count as user code.)
_RUNTIME_PACKAGES = (
    "zerotrain.engine",
    "zerotrain.zero",
    "zerotrain.comm",
    "zerotrain.checkpoint",
    "zerotrain.runtime",
    "zerotrain.precision",
    "zerotrain.optim",
)


def _called_from_zerotrain(depth: int = 2) -> bool:
    """Whether the torch call (or module construction) ``depth`` frames up comes from
    zerotrain's runtime (``initialize`` run inside the context, say) rather than user code."""
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != "torch" and not name.startswith("torch."):
            return any(name == p or name.startswith(p + ".") for p in _RUNTIME_PACKAGES)
        frame = frame.f_back
    return False


class _PlaceholderMode(TorchFunctionMode):
    """Gathers a placeholder whole before any torch function uses its values (see module doc)."""

    def __init__(self, context: Init):
        super().__init__()
        self.context = context

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if own_code.depth or func in _VALUE_FREE:
            return func(*args, **kwargs)
        placeholders = _find_placeholders(args, kwargs)
        if placeholders and not _called_from_zerotrain():
            if func in _SHAPE_QUERIES and args and args[0] is placeholders[0]:
                answer = _answer_shape_query(func, args, kwargs)
                if answer is not NotImplemented:
                    return answer
            self.context._make_whole(placeholders)
        return func(*args, **kwargs)
