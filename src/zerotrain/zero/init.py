"""``zerotrain.zero.Init`` (DeepSpeed's ZeRO-3 API; ``GatheredParameters`` is in zero.gathered).

``Init`` partitions every parameter the moment its module's constructor returns: rank 0's values
are broadcast (so all ranks agree whatever their RNG did), each rank keeps its 1/N slice, and the
parameter itself becomes an empty placeholder. A model larger than one process's memory can so be
built. ``initialize`` with stage 3 then regroups these slices into its units, one module at a time.

Weight initialisation that runs *after* a module's constructor (a parent's ``self.apply(init_fn)``,
Hugging Face ``post_init()``, ``module.weight.data.normal_()``) would otherwise see empty
placeholders. While the context is active, a ``TorchFunctionMode`` catches any torch function,
method or property that receives a placeholder: it gathers that parameter whole first (the same on
every rank) and keeps it whole until a placeholder of another module is touched, or the outermost
constructor or the context ends; then it is partitioned again from rank 0's values. Constructors
and init functions so consume the RNG exactly as in a normal build, and the weights are identical,
while at most about one module's parameters are whole at a time. Shape queries (``.shape``,
``size()``, ``dim()``, ``numel()``) and attributes that do not depend on the values (``dtype``,
``requires_grad``, ...) are answered without gathering. Calls from zerotrain's runtime
(``initialize``, the engine, ``GatheredParameters``) pass through untouched.

Groups: every partitioned parameter records how it was partitioned (``partitioning_of``: the
``data_parallel_group``, None for the world, and host placement). Gathering it back
(``materialize``, ``GatheredParameters``, the mode) and partitioning it again use that group and
the ranks in it, whichever ``Init`` context is active at the time; ``initialize`` checks that its
own data-parallel group holds the same ranks.

Why the active context is process-wide: a ``with Init():`` block patches ``__init__`` of every
``nn.Module`` class (and pushes one ``TorchFunctionMode``), and a constructor called anywhere in
the process, by any library, must find the context that patched it. So ``_active`` (the
outermost context, which owns the patches, the mode and the parameters it gathered whole) is a
module global, as DeepSpeed's is. Contexts entered inside it are kept on ``_nested``: modules
constructed while one is innermost are partitioned with its settings (group, dtype, host
placement), and when it exits the outer one's apply again. Contexts entered one after another
share nothing but the parameters' own records.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from zerotrain.accelerator import get_accelerator
from zerotrain.comm import collectives
from zerotrain.comm.distributed import init_distributed
from zerotrain.memory_release import configure_allocator, release_freed_memory
from zerotrain.zero.flat import FlatLayout
from zerotrain.zero.init_config import dtype_from_config
from zerotrain.zero.partition import shard_alignment

if TYPE_CHECKING:
    from types import FrameType

    from torch.distributed import ProcessGroup

_SHARD = "_zerotrain_shard"  # this rank's slice of an Init-partitioned parameter
_LAYOUT = "_zerotrain_layout"  # its FlatLayout (shape, padding)
_OWNER = "_zerotrain_owner"  # id of the module it was first partitioned in (eviction groups)
_DEPTH = "_zerotrain_init_depth"  # a module's nesting of Init-wrapped __init__ calls
_WRAPPER = "__zerotrain_init_wrapper__"  # marks the __init__ wrappers Init installs
_PARTITIONING = "_zerotrain_partitioning"  # how it was partitioned (kept while it is whole)

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Partitioning(NamedTuple):
    """How ``Init`` partitioned a parameter: over ``group`` (None: the world), with the slices
    in host memory (``host``), page-locked (``pin``)."""

    group: ProcessGroup | None = None
    host: bool = False
    pin: bool = False


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a parameter partitioned by ``Init`` and not yet taken over by ``initialize``."""
    return hasattr(param, _SHARD)


def full_numel(param: torch.Tensor) -> int:
    """``param``'s element count whole (an ``Init``-partitioned placeholder holds none)."""
    layout = getattr(param, _LAYOUT, None)
    return layout.numel if is_partitioned(param) and layout is not None else param.numel()


def partitioning_of(param: torch.Tensor) -> Partitioning | None:
    """How ``Init`` partitioned ``param`` (also while it is gathered whole), or None."""
    return getattr(param, _PARTITIONING, None)


def group_ranks(group) -> list[int]:
    """The global ranks of ``group`` (None: the world)."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def check_member(group, what: str) -> None:
    """Raise naming ``what`` when this process is not a member of ``group``."""
    if group is not None and dist.is_initialized() and dist.get_rank(group) < 0:
        raise ValueError(
            f"{what}: this process is not in the group (ranks {group_ranks(group)}); call it on the group's ranks only"
        )


# -- zerotrain's own code handles placeholders directly (the mode passes it through) ---------
_own_code_depth = 0


@contextlib.contextmanager
def _own_code():
    global _own_code_depth
    _own_code_depth += 1
    try:
        yield
    finally:
        _own_code_depth -= 1


@torch.no_grad()
def _keep_shard(param: nn.Parameter, how: Partitioning) -> None:
    """Keep only this rank's slice of a whole ``param`` (no padded full-size temporary) among
    ``how.group``'s ranks; in host memory with ``how.host`` (parameter offload), page-locked with
    ``how.pin``. The parameter records ``how``."""
    with _own_code():
        world, rank = dist.get_world_size(how.group), dist.get_rank(how.group)
        layout = FlatLayout([param], world, shard_alignment(param.dtype))
        start, end = layout.shard_range(rank)
        host, pin = how.host, how.pin
        device = torch.device("cpu") if host else param.device  # host memory is torch's "cpu"
        shard = torch.zeros(layout.shard_numel, dtype=param.dtype, device=device)
        flat = param.data.reshape(-1)
        if start < flat.numel():
            shard[: min(end, flat.numel()) - start].copy_(flat[start:end])
        if host and pin and device != param.device:
            shard = get_accelerator().pin_memory(shard)
        setattr(param, _SHARD, shard)
        setattr(param, _LAYOUT, layout)
        setattr(param, _PARTITIONING, how)
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)


_OWN_GROUP = object()


@torch.no_grad()
def materialize(param: nn.Parameter, group=_OWN_GROUP) -> None:
    """Gather an Init-partitioned parameter back into a whole tensor (a collective of the group
    it was partitioned over). ``group``: the data-parallel group the caller works over (None:
    the world), which must hold the same ranks (else ValueError naming both); left out, the
    parameter's own group."""
    with _own_code():
        layout: FlatLayout = getattr(param, _LAYOUT)
        own = getattr(param, _PARTITIONING).group
        if group is not _OWN_GROUP and group is not own and dist.is_initialized():
            theirs, mine = group_ranks(group), group_ranks(own)
            if sorted(theirs) != sorted(mine):
                raise ValueError(
                    f"a parameter of shape {tuple(layout.slots[0].shape)} was partitioned by "
                    f"zero.Init over ranks {mine}, but the engine's data-parallel group is ranks "
                    f"{theirs}: pass the engine's group to zero.Init(data_parallel_group=...)"
                )
        shard = getattr(param, _SHARD).to(param.device)  # the model may have moved since Init
        flat = layout.empty(dtype=shard.dtype, device=shard.device, zero=False)
        collectives.all_gather_into(flat, shard, group=own)
        # A view, not a copy: the padding (under world * alignment elements) is not worth a
        # second whole-size temporary.
        param.data = flat.narrow(0, 0, layout.numel).view(layout.slots[0].shape)
        delattr(param, _SHARD)
        delattr(param, _LAYOUT)


# -- the torch-function mode -------------------------------------------------------------------
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
        if _own_code_depth or func in _VALUE_FREE:
            return func(*args, **kwargs)
        placeholders = _find_placeholders(args, kwargs)
        if placeholders and not _called_from_zerotrain():
            if func in _SHAPE_QUERIES and args and args[0] is placeholders[0]:
                answer = _answer_shape_query(func, args, kwargs)
                if answer is not NotImplemented:
                    return answer
            self.context._make_whole(placeholders)
        return func(*args, **kwargs)


# -- Init --------------------------------------------------------------------------------------
# Process-wide because the constructors it patches are (see the module docstring).
_active: Init | None = None  # the outermost entered (and not shut down) Init context
_suspended: Init | None = None  # a context shut down by shutdown_init_context()
_nested: list[Init] = []  # contexts entered inside the outermost one, innermost last


def _innermost() -> Init | None:
    """The context whose settings partition the modules constructed now."""
    return _nested[-1] if _nested else _active


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


class Init:
    """Partition parameters as modules are constructed (``with zerotrain.zero.Init(): model = ...``).

    DeepSpeed's arguments:

    - ``module``: partition an already built model now (every parameter of its tree).
    - ``data_parallel_group``: the group to partition over (default: all ranks); this process
      must be in it. Each parameter remembers it: gathers and re-partitions use its ranks, and
      ``GatheredParameters(modifier_rank=r)`` takes ``r`` as a rank of that group.
    - ``config_dict_or_path`` (``config`` is its deprecated alias): a ds_config dict or JSON path.
      As in DeepSpeed its ``bf16``/``fp16`` sections set the dtype of the partitions (float32 when
      neither is enabled) unless ``dtype`` is given, and ``zero_optimization.offload_param``'s
      ``device`` and ``pin_memory`` stand for ``remote_device`` and ``pin_memory`` (as in DeepSpeed).
      Unfilled ``"auto"`` values are ignored (their defaults apply), as DeepSpeed's Init does.
    - ``dtype``: cast floating-point parameters to it (float16, bfloat16 or float32) when they
      are partitioned. With neither ``dtype`` nor a config the constructors' dtype is kept
      (DeepSpeed would cast to float16; ``initialize`` casts to the config's precision anyway).
    - ``remote_device``: "cpu" or "nvme" keep the partitions in host memory (page-locked with
      ``pin_memory`` where the accelerator supports it; on a CPU-only machine they are there
      anyway); with "nvme", ``initialize`` then moves them to swap files under the config's
      ``offload_param.nvme_path`` (docs/offload.md). None/"none": on the accelerator.
    - ``mem_efficient_linear``: accepted, no effect (DeepSpeed swaps ``F.linear`` for a version
      its own parameter release needs; stage 3 here frees and refills saved weights itself).
    - ``enabled=False`` makes it do nothing; ``mpu`` and the other DeepSpeed arguments (ZeRO++,
      hpZ, ``param_swapper``) raise NotImplementedError.
    """

    def __init__(
        self,
        module=None,
        data_parallel_group=None,
        mem_efficient_linear=True,
        remote_device=None,
        pin_memory=False,
        config_dict_or_path=None,
        config=None,
        enabled=True,
        dtype=None,
        mpu=None,
        **unsupported,
    ):
        if unsupported:
            raise NotImplementedError(f"zero.Init arguments not supported: {sorted(unsupported)}")
        if mpu is not None:
            raise NotImplementedError("zero.Init(mpu=...): model parallelism is not supported")
        if config is not None:
            if config_dict_or_path is not None:
                raise ValueError(
                    "zero.Init: pass the ds_config as config_dict_or_path only "
                    "(config= is its deprecated alias), not both"
                )
            config_dict_or_path = config
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f'zero.Init(remote_device={remote_device!r}): use None, "none", "cpu" or "nvme"')
        if dtype is not None and dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"zero.Init(dtype={dtype}): use torch.float16, torch.bfloat16 or torch.float32")
        self.enabled = enabled
        self.group = data_parallel_group
        check_member(data_parallel_group, "zero.Init(data_parallel_group=...)")
        self.pin_memory = bool(pin_memory)
        self.dtype = dtype
        if config_dict_or_path is not None:
            config_dtype, offload = dtype_from_config(config_dict_or_path, data_parallel_group)
            self.dtype = config_dtype if dtype is None else dtype
            if offload is not None:  # the config's offload_param wins, as in DeepSpeed
                remote_device, self.pin_memory = offload.device, bool(offload.pin_memory)
        # Partitions in host memory (offload_param cpu/nvme; see _keep_shard).
        self.host = remote_device in ("cpu", "nvme")
        self._patched: dict[type, object] = {}
        self._saved_init_subclass = None
        self._mode: _PlaceholderMode | None = None
        self._whole: dict[int, nn.Parameter] = {}  # placeholders gathered whole for a moment
        self._building = 0  # nesting of module constructions under way
        # Outermost modules built while this context was the innermost one.
        self._roots: weakref.WeakSet = weakref.WeakSet()
        self._outer: Init | None = None  # the active context this one is nested in
        if enabled:
            configure_allocator()  # see zerotrain.memory_release
        if module is not None and enabled:
            self._ensure_distributed()
            self._partition_tree(module)

    def _ensure_distributed(self) -> None:
        if not dist.is_initialized():
            init_distributed()

    # -- context ------------------------------------------------------------------------
    def __enter__(self):
        global _active
        if not self.enabled:
            return self
        if _suspended is not None:
            raise RuntimeError(
                "zero.Init entered while another Init context is shut down "
                "(shutdown_init_context); call restore_init_context() first"
            )
        if _active is not None:  # nested: the outer context's patches and mode serve it too
            if self in _nested or self is _active:
                raise RuntimeError("this zero.Init context is already active; create a new one")
            self._outer = _active
            _nested.append(self)
            return self
        self._ensure_distributed()
        _active = self
        self._patch_classes()
        self._mode = _PlaceholderMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, *exc):
        global _active, _suspended, _own_code_depth
        if not self.enabled:
            return False
        if self._outer is not None:
            outer, self._outer = self._outer, None
            try:
                if exc_type is None and self in _nested:  # partition what was added after
                    for root in list(self._roots):  # construction, with its settings
                        outer._partition_tree(root, settings=self)
                    if _active is outer:
                        outer._flush()
            finally:
                if self in _nested:
                    _nested.remove(self)
                self._roots = weakref.WeakSet()
            return False
        try:
            if exc_type is None and _active is self:  # after an error ranks may be out of step
                for root in list(self._roots):
                    self._partition_tree(root)
                self._flush()
        finally:
            if _active is self:
                self._unpatch_classes()
                _active = None
            elif _suspended is self:  # exited while shut down: classes are already restored
                _own_code_depth -= 1
                _suspended = None
            if _active is None and _suspended is None:
                _nested.clear()  # contexts left entered by a failure are over with it
            self._mode.__exit__(None, None, None)
            self._mode = None
            self._whole.clear()
            self._roots = weakref.WeakSet()
        return False

    def _patch_classes(self) -> None:
        for cls in [nn.Module, *_all_subclasses(nn.Module)]:
            self._patch(cls)
        # Classes defined inside the context get their __init__ wrapped when they are created.
        self._saved_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        patch = self._patch

        def __init_subclass__(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            patch(cls)

        # Monkeypatching nn.Module's class hook, which mypy types as object's plain method.
        nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[method-assign, assignment]

    def _patch(self, cls) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or cls in self._patched or getattr(original, _WRAPPER, False):
            return
        self._patched[cls] = original
        cls.__init__ = _wrap_init(original)

    def _unpatch_classes(self) -> None:
        if self._saved_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._saved_init_subclass  # type: ignore[method-assign]  # restoring the saved hook
        for cls, original in self._patched.items():
            if getattr(cls.__dict__.get("__init__"), _WRAPPER, False):  # else someone replaced it
                cls.__init__ = original  # type: ignore[misc]  # restoring the constructor wrapped above
        self._patched.clear()

    def _constructed(self, module: nn.Module, outermost: bool) -> None:
        """A module's (most derived) constructor returned (``self`` is the outermost context)."""
        settings = _innermost() or self
        self._partition_tree(module, settings)
        if outermost:
            settings._roots.add(module)
            self._flush()

    # -- partitioning -------------------------------------------------------------------
    @property
    def partitioning(self) -> Partitioning:
        return Partitioning(self.group, self.host, self.pin_memory)

    def _partition_tree(self, module: nn.Module, settings: Init | None = None) -> None:
        """Partition every parameter of ``module``'s tree that is not partitioned yet: new ones
        with ``settings``' group, dtype and placement (default this context's), ones gathered
        whole by the mode again as they were."""
        settings = settings or self
        done = False
        for m in module.modules():
            for param in m._parameters.values():
                if param is None or is_partitioned(param) or _taken_over(param):
                    continue
                was_gathered = self._whole.pop(id(param), None) is not None
                if hasattr(param, _OWNER) and not was_gathered:
                    continue  # Init partitioned it before; someone (initialize) took it over
                if was_gathered:
                    self._repartition(param)
                else:
                    settings._partition(param, owner=m)
                done = True
        if done:
            release_freed_memory()

    @torch.no_grad()
    def _partition(self, param: nn.Parameter, owner: nn.Module | None = None) -> None:
        """Cast a whole ``param`` to this context's dtype, broadcast the group's first rank's
        values and keep this rank's slice."""
        with _own_code():
            param.data = param.data.to(get_accelerator().device())
            if self.dtype is not None and param.is_floating_point():
                param.data = param.data.to(self.dtype)
            _broadcast_and_keep_shard(param, self.partitioning)
            if owner is not None and not hasattr(param, _OWNER):
                setattr(param, _OWNER, id(owner))

    def _make_whole(self, placeholders: list[nn.Parameter]) -> None:
        """Gather ``placeholders``; first re-partition gathered ones of other modules."""
        owners = {getattr(p, _OWNER, None) for p in placeholders}
        evicted = [key for key, p in self._whole.items() if getattr(p, _OWNER, None) not in owners]
        for key in evicted:
            self._repartition(self._whole.pop(key))
        if evicted:  # the whole tensors just freed sit between shards: hand them back
            release_freed_memory()
        for param in placeholders:
            materialize(param)  # over the group it was partitioned over
            self._whole[id(param)] = param
        release_freed_memory()

    @staticmethod
    def _repartition(param: nn.Parameter) -> None:
        """Partition a parameter the mode gathered whole again, as it was partitioned before
        (whichever context is active now)."""
        # GatheredParameters or initialize may have taken it over meanwhile.
        if not is_partitioned(param) and not _taken_over(param):
            with _own_code():
                how = partitioning_of(param)
                assert how is not None  # the mode gathers partitioned parameters only
                _broadcast_and_keep_shard(param, how)

    def _flush(self) -> None:
        """Re-partition every parameter gathered whole by the mode."""
        whole, self._whole = list(self._whole.values()), {}
        for param in whole:
            self._repartition(param)
        if whole:
            release_freed_memory()


@torch.no_grad()
def _broadcast_and_keep_shard(param: nn.Parameter, how: Partitioning) -> None:
    """Broadcast the first rank of ``how.group``'s values of a whole ``param``; keep this rank's
    slice as ``how`` says."""
    src = dist.get_global_rank(how.group, 0) if how.group is not None else 0
    collectives.broadcast(param.data, src=src, group=how.group)
    _keep_shard(param, how)


def _wrap_init(original):
    """``original`` (a module class's ``__init__``) that partitions the module when it returns."""

    @functools.wraps(original)
    def init(module, *args, **kwargs):
        context = _active
        if context is None or _own_code_depth:  # shut down, or zerotrain's own modules
            return original(module, *args, **kwargs)
        depth = module.__dict__.get(_DEPTH, 0)
        if depth == 0 and _called_from_zerotrain():  # e.g. the engine, built by initialize
            context._flush()  # what it takes over must be partitioned or whole for good
            with _own_code():
                return original(module, *args, **kwargs)
        object.__setattr__(module, _DEPTH, depth + 1)
        context._building += 1
        try:
            original(module, *args, **kwargs)
        finally:
            context._building -= 1
            if depth:
                object.__setattr__(module, _DEPTH, depth)
            else:
                module.__dict__.pop(_DEPTH, None)
        if depth == 0:  # the most derived constructor has finished
            context._constructed(module, outermost=context._building == 0)

    setattr(init, _WRAPPER, True)
    return init


def shutdown_init_context() -> None:
    """Suspend the active ``Init`` context (DeepSpeed's name): constructors and torch functions
    behave normally until ``restore_init_context()``. (``initialize`` does not need it: calls
    from zerotrain's runtime pass through the context anyway.)"""
    global _active, _suspended, _own_code_depth
    context = _active
    if context is None:
        return
    context._flush()
    context._unpatch_classes()
    _active, _suspended = None, context
    _own_code_depth += 1  # the mode stays on the stack but passes everything through


def restore_init_context() -> None:
    """Resume the ``Init`` context suspended by ``shutdown_init_context()``."""
    global _active, _suspended, _own_code_depth
    context = _suspended
    if context is None:
        return
    _own_code_depth -= 1
    _active, _suspended = context, None
    context._patch_classes()


def _taken_over(param: torch.Tensor) -> bool:
    """True once an engine's unit holds ``param`` (initialize has taken it over)."""
    from zerotrain.zero import registry

    return registry.unit_of(param) is not None
