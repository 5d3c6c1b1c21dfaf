"""Values of ``client_state`` and scheduler state, stored so they load back equal and of the same type.

A checkpoint's per-rank state file is read with ``torch.load(..., weights_only=True)``, which
rebuilds only containers, numbers, strings and tensors (never an arbitrary pickled class). Values
of other types are written as *tagged* dicts (``{"__zerotrain_type__": kind, ...}``) made of
those, and :func:`decode` turns them back into the original types after loading:

==========================  ===============================================================
numpy scalars               ``np.float64`` (what ``np.mean`` returns), ``np.int64``,
                            ``np.float32``, ``np.bool_``, ``np.str_``, ... (not ``longdouble``,
                            dates or objects): dtype and exact value
numpy arrays                numeric and bool dtypes: dtype, shape and the raw bytes
``Enum`` members            (``IntEnum``, ``str`` enums, ``Flag``) the class and the value
namedtuples                 the class, its field names and the items
``OrderedDict``             kept as is (``weights_only`` rebuilds it); tagged only when its
                            keys need encoding
``defaultdict``             with ``default_factory`` None or one of :data:`FACTORIES`
``set``, ``frozenset``      the items
dicts with other keys       (an enum, a numpy integer, a namedtuple as key) the item pairs
``torch.nn.Parameter``      the data and ``requires_grad``
==========================  ===============================================================

Plain ``dict``/``list``/``tuple``/``str``/``int``/``float``/``bool``/``complex``/``bytes``/
``None``, tensors, ``torch.Size``, ``torch.dtype`` and ``torch.device`` are stored as they are.
Anything else (a function, a custom object, a dict subclass, a defaultdict of a lambda) is
refused at save time by :func:`encode` with a message naming the key path and what to do.

**Classes named in a file.** An enum or namedtuple records its class as ``module:qualname``.
Loading never imports a module: the class is looked up only among modules the program has
already imported (``sys.modules``), by walking ``__dict__`` entries (no ``__getattr__`` hook
runs), and it is used only if it is an ``Enum`` subclass (rebuilt with ``cls(value)``) or a
namedtuple with the recorded fields (rebuilt with ``cls._make(items)``). A file can thus only
choose among enum and namedtuple classes the program itself loaded; a class whose module is
not imported yet raises ``CheckpointError`` saying which module to import before
``load_checkpoint``. Classes defined inside a function (``<locals>``) cannot be found again and
are refused at save time.
"""

from __future__ import annotations

import enum
import sys
from collections import OrderedDict, defaultdict

import numpy as np
import torch

TAG = "__zerotrain_type__"

#: ``defaultdict`` factories that are rebuilt (by name, from this table only).
FACTORIES = {f.__name__: f for f in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bool)}
FACTORIES["OrderedDict"] = OrderedDict

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)
_NUMPY_KINDS = "biufcUS"  # bool, signed/unsigned int, float, complex, unicode and byte strings
_ARRAY_KINDS = "biufc"


class _Tagged(dict):
    """An encoded value in memory. ``encode`` copies it as it is (so encoding twice changes
    nothing) and it is pickled as an ``OrderedDict``, which ``weights_only`` loading rebuilds."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):
        return OrderedDict, (), None, None, iter(self.items())


def _tagged(kind: str, **fields) -> _Tagged:
    out = _Tagged({TAG: kind})
    out.update(fields)
    return out


class StateTypeError(TypeError):
    """A value ``encode`` cannot store so that it loads back equal and of the same type."""


class StateDecodeError(ValueError):
    """A tagged value in a state file cannot be rebuilt (its class is not loaded, ...)."""


def _refuse(where: str, what: str, fix: str):
    raise StateTypeError(
        f"{where} {what}, which a checkpoint cannot store so that it loads back as the same type; {fix}"
    )


_GENERIC_FIX = (
    "keep such state out of it or convert it to numbers, strings, tensors, numpy values, "
    "enums, namedtuples or containers of them"
)


def encode(value, where: str):
    """A copy of ``value`` that ``torch.load(weights_only=True)`` reads and :func:`decode` turns
    back into an equal value of the same type. Tensors are detached copies. Raises
    ``StateTypeError`` naming ``where`` (the key path) for a value it cannot store so."""
    t = type(value)
    if t in _ATOMS:
        return value
    if t is _Tagged:
        return _Tagged((k, encode(v, where) if k != TAG else v) for k, v in value.items())
    if t is torch.Tensor:
        return value.detach().clone()
    if t is torch.nn.Parameter:
        return _tagged("parameter", data=value.detach().clone(), requires_grad=value.requires_grad)
    if t is dict or t is OrderedDict:
        return _encode_mapping(value, where, t)
    if t is defaultdict:
        factory = value.default_factory
        name = None if factory is None else next((n for n, f in FACTORIES.items() if f is factory), False)
        if name is False:
            _refuse(
                where,
                f"is a defaultdict whose default_factory is {factory!r}",
                f"use one of {', '.join(sorted(FACTORIES))} as its factory, or convert it with dict(...)",
            )
        return _tagged("defaultdict", factory=name, items=_encode_items(value, where))
    if t is list:
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if t is tuple:
        return tuple(encode(v, f"{where}[{i}]") for i, v in enumerate(value))
    if t is set or t is frozenset:
        return _tagged(t.__name__, items=[encode(v, f"{where}[{i}]") for i, v in enumerate(value)])
    if isinstance(value, enum.Enum):
        return _tagged("enum", cls=_class_name(t, where, "enum"), value=encode(value.value, f"{where}.value"))
    if isinstance(value, tuple) and _is_namedtuple(t):
        return _tagged(
            "namedtuple",
            cls=_class_name(t, where, "namedtuple"),
            fields=list(t._fields),
            items=[encode(v, f"{where}.{f}") for f, v in zip(t._fields, value)],
        )
    if isinstance(value, np.generic):
        return _encode_numpy_scalar(value, where)
    if t is np.ndarray:
        return _encode_array(value, where)
    if isinstance(value, torch.Tensor):
        _refuse(
            where,
            f"is a {t.__module__}.{t.__qualname__} (a tensor subclass)",
            "store a plain tensor (tensor.detach().clone().as_subclass(torch.Tensor))",
        )
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        base = next(b for b in (dict, list, tuple, set, frozenset) if isinstance(value, b))
        _refuse(
            where,
            f"is a {t.__module__}.{t.__qualname__} (a {base.__name__} subclass)",
            f"convert it with {base.__name__}(...)",
        )
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    _refuse(where, f"holds a value of type {name}", _GENERIC_FIX)


def _plain_key(key) -> bool:
    t = type(key)
    if t is tuple:
        return all(_plain_key(k) for k in key)
    return t in _ATOMS and key != TAG


def _encode_items(mapping, where: str) -> list:
    return [[encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")] for k, v in mapping.items()]


def _encode_mapping(value, where: str, t):
    if all(_plain_key(k) for k in value):
        return t((k, encode(v, f"{where}[{k!r}]")) for k, v in value.items())
    return _tagged("dict" if t is dict else "OrderedDict", items=_encode_items(value, where))


def _encode_numpy_scalar(value, where: str):
    dtype = value.dtype
    if dtype.kind not in _NUMPY_KINDS or _extended(dtype):
        _refuse(
            where,
            f"holds a numpy {dtype.name}",
            "convert it to a Python number, a string or a "
            "supported numpy type (bool, integers, float16/32/64, complex64/128, str_, bytes_)",
        )
    return _tagged("numpy", dtype=dtype.str, value=value.item())


def _extended(dtype: np.dtype) -> bool:
    """``longdouble``/``clongdouble``: their values do not survive a Python float."""
    return (dtype.kind == "f" and dtype.itemsize > 8) or (dtype.kind == "c" and dtype.itemsize > 16)


def _encode_array(value: np.ndarray, where: str):
    dtype = value.dtype
    if dtype.kind not in _ARRAY_KINDS or dtype.fields is not None or _extended(dtype):
        _refuse(
            where,
            f"is a numpy array of dtype {dtype}",
            "use a bool, integer, float16/32/64 or complex64/128 array, or a tensor",
        )
    raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    return _tagged("ndarray", dtype=dtype.str, shape=list(value.shape), data=torch.from_numpy(raw.copy()))


def _is_namedtuple(t) -> bool:
    fields = getattr(t, "_fields", None)
    return isinstance(fields, tuple) and all(type(f) is str for f in fields) and callable(getattr(t, "_make", None))


def _class_name(cls, where: str, kind: str) -> str:
    """``module:qualname`` of ``cls``, checked to be found again by :func:`_find_class`."""
    name = f"{cls.__module__}:{cls.__qualname__}"
    if "<locals>" in cls.__qualname__ or _lookup(cls.__module__, cls.__qualname__) is not cls:
        _refuse(
            where,
            f"is a {kind} {cls.__qualname__} that cannot be found again by its name "
            f"{name} (defined inside a function or rebound)",
            f"define the {kind} at module level, or store its value instead",
        )
    return name


def _lookup(module: str, qualname: str):
    """``module.qualname`` among the modules already imported (never imports; walks ``__dict__``
    entries only, so no module ``__getattr__`` runs); None if absent."""
    obj = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None:
            return None
        try:
            namespace = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            return None
        obj = namespace.get(part)
    return obj


def _find_class(spec, kind: str, where: str):
    if type(spec) is not str or spec.count(":") != 1:
        raise StateDecodeError(f"{where}: damaged {kind} class name {spec!r}")
    module, qualname = spec.split(":")
    if module not in sys.modules:
        raise StateDecodeError(
            f"{where} was saved as the {kind} {qualname} from module {module}, which this program has "
            f"not imported: import {module} before load_checkpoint (a checkpoint never imports a "
            "module it names)"
        )
    cls = _lookup(module, qualname)
    if cls is None:
        raise StateDecodeError(
            f"{where} was saved as the {kind} {module}.{qualname}, which no longer exists in {module}"
        )
    return cls


def decode(value, where: str = "state"):
    """The values :func:`encode` stored, rebuilt from what ``torch.load(weights_only=True)``
    returned. Raises ``StateDecodeError`` naming ``where`` when a tagged value cannot be rebuilt."""
    t = type(value)
    if t is dict or t is OrderedDict:
        if TAG in value:
            return _decode_tagged(value, where)
        return t((k, decode(v, f"{where}[{k!r}]")) for k, v in value.items())
    if t is list:
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if t is tuple:
        return tuple(decode(v, f"{where}[{i}]") for i, v in enumerate(value))
    return value


def _pairs(node, where):
    return [(decode(k, f"{where} key"), decode(v, f"{where}[{k!r}]")) for k, v in node["items"]]


def _decode_tagged(node, where: str):
    kind = node[TAG]
    try:
        if kind == "numpy":
            dtype = _safe_dtype(node["dtype"], _NUMPY_KINDS, where)
            return dtype.type(node["value"])
        if kind == "ndarray":
            dtype = _safe_dtype(node["dtype"], _ARRAY_KINDS, where)
            data = node["data"].numpy().tobytes()
            return np.frombuffer(data, dtype=dtype).reshape(node["shape"]).copy()
        if kind == "enum":
            cls = _find_class(node["cls"], "enum", where)
            if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
                raise StateDecodeError(f"{where}: {node['cls']} is not an Enum; refusing to call it")
            return cls(decode(node["value"], f"{where}.value"))
        if kind == "namedtuple":
            cls = _find_class(node["cls"], "namedtuple", where)
            if not (
                isinstance(cls, type)
                and issubclass(cls, tuple)
                and _is_namedtuple(cls)
                and list(cls._fields) == list(node["fields"])
            ):
                raise StateDecodeError(
                    f"{where}: {node['cls']} is not a namedtuple with the fields "
                    f"{node['fields']} (was it changed since the save?)"
                )
            return cls._make(decode(v, f"{where}.{f}") for f, v in zip(node["fields"], node["items"]))
        if kind in ("dict", "OrderedDict"):
            return (dict if kind == "dict" else OrderedDict)(_pairs(node, where))
        if kind == "defaultdict":
            name = node["factory"]
            if name is not None and name not in FACTORIES:
                raise StateDecodeError(f"{where}: unknown defaultdict factory {name!r}")
            return defaultdict(None if name is None else FACTORIES[name], _pairs(node, where))
        if kind in ("set", "frozenset"):
            items = (decode(v, f"{where}[{i}]") for i, v in enumerate(node["items"]))
            return set(items) if kind == "set" else frozenset(items)
        if kind == "parameter":
            return torch.nn.Parameter(node["data"], requires_grad=bool(node["requires_grad"]))
    except StateDecodeError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise StateDecodeError(f"{where}: damaged {kind!r} value ({type(error).__name__}: {error})") from None
    raise StateDecodeError(f"{where}: unknown stored type {kind!r} (saved by a newer zerotrain?)")


def _safe_dtype(spec, kinds: str, where: str) -> np.dtype:
    if type(spec) is not str or len(spec) > 8:
        raise StateDecodeError(f"{where}: damaged numpy dtype {spec!r}")
    dtype = np.dtype(spec)
    if dtype.kind not in kinds or dtype.hasobject or dtype.fields is not None or _extended(dtype):
        raise StateDecodeError(f"{where}: numpy dtype {spec!r} is not one a checkpoint stores")
    return dtype
