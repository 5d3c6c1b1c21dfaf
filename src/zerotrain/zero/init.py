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

import functools
import weakref

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.accelerator import get_accelerator
from zerotrain.comm.distributed import init_distributed
from zerotrain.memory_release import configure_allocator, release_freed_memory
from zerotrain.zero.init_config import dtype_from_config
from zerotrain.zero.partitioned_param import (
    _OWNER,
    Partitioning,
    _broadcast_and_keep_shard,
    _own_code,
    _taken_over,
    check_member,
    full_numel,  # noqa: F401  # also importable from zero.init
    group_ranks,  # noqa: F401  # also importable from zero.init
    is_partitioned,
    materialize,
    own_code,
    partitioning_of,
)
from zerotrain.zero.placeholder_mode import _called_from_zerotrain, _PlaceholderMode

_DEPTH = "_zerotrain_init_depth"  # a module's nesting of Init-wrapped __init__ calls
_WRAPPER = "__zerotrain_init_wrapper__"  # marks the __init__ wrappers Init installs

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
        global _active, _suspended
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
                own_code.depth -= 1
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


def _wrap_init(original):
    """``original`` (a module class's ``__init__``) that partitions the module when it returns."""

    @functools.wraps(original)
    def init(module, *args, **kwargs):
        context = _active
        if context is None or own_code.depth:  # shut down, or zerotrain's own modules
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
    global _active, _suspended
    context = _active
    if context is None:
        return
    context._flush()
    context._unpatch_classes()
    _active, _suspended = None, context
    own_code.depth += 1  # the mode stays on the stack but passes everything through


def restore_init_context() -> None:
    """Resume the ``Init`` context suspended by ``shutdown_init_context()``."""
    global _active, _suspended
    context = _suspended
    if context is None:
        return
    own_code.depth -= 1
    _active, _suspended = context, None
    context._patch_classes()
