"""``client_state`` and scheduler state come back from ``load_checkpoint`` equal and of the same
type (numpy scalars and arrays, enums, namedtuples, ordered/default dicts, sets, nested), or are
refused at save time naming the key path; the state files are still read without unpickling any
class, and a deleted one is a ``CheckpointError`` naming it."""

from __future__ import annotations

import enum
import io
import sys
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch

from zerotrain.checkpoint.state_codec import TAG, StateDecodeError, StateTypeError, decode, encode
from zerotrain.testing import run_on_ranks


class Color(enum.IntEnum):
    RED = 1
    BLUE = 2


class Split(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Perm(enum.Flag):
    R = 1
    W = 2


class Phase(enum.Enum):
    WARMUP = (1, "w")


Point = namedtuple("Point", "x y")


def _table() -> dict:
    """One entry per type (name -> value); nested entries mix them."""
    return {
        "np_mean": np.mean([1.0, 2.5, 4.0]),  # np.float64, what np.mean returns
        "np_float64": np.float64(0.1),
        "np_float32": np.float32(1 / 3),
        "np_float16": np.float16(0.3),
        "np_int64": np.int64(-(2**62)),
        "np_int32": np.int32(7),
        "np_uint8": np.uint8(255),
        "np_uint64": np.uint64(2**64 - 1),
        "np_bool": np.bool_(True),
        "np_complex": np.complex64(1 - 2j),
        "np_str": np.str_("tok"),
        "np_array": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        "np_int_array_fortran": np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
        "np_bool_array": np.array([True, False]),
        "int_enum": Color.BLUE,
        "str_enum": Split.EVAL,
        "flag": Perm.R | Perm.W,
        "tuple_enum": Phase.WARMUP,
        "namedtuple": Point(1, 2.5),
        "torch_size": torch.Size([3, 4]),
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        "defaultdict": defaultdict(list, {"x": [1, 2]}),
        "defaultdict_none": defaultdict(None, {"y": 1}),
        "set": {1, 2, 3},
        "frozenset": frozenset({"a", "b"}),
        "tensor": torch.arange(4.0),
        "parameter": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "dtype_device": (torch.bfloat16, torch.device("cpu")),
        "plain": {
            "epoch": 3,
            "loss": 1.5,
            "name": "run",
            "none": None,
            "flag": True,
            "c": 1j,
            "bytes": b"\x00\xff",
            "nested": [1, (2, [3.0])],
        },
        "enum_keys": {Color.RED: "r", np.int64(3): "three", Point(0, 0): "origin", (1, Split.TRAIN): "t"},
        "reserved_key": {TAG: "numpy", "dtype": "<f8", "value": 1.0},  # a user dict, not a tag
        "nested": [
            Point(np.float32(0.5), Split.TRAIN),
            OrderedDict([("m", {"mean": np.mean([1, 2]), "hist": np.array([1, 2], np.int16)})]),
            defaultdict(int, {Color.RED: np.int64(4)}),
            (Perm.W, {frozenset({Color.BLUE})}),
            {"deep": [[{"x": np.bool_(False)}]]},
        ],
    }


def _same(a, b, where="value") -> list[str]:
    """Differences in value or type between ``a`` and ``b``, recursively (empty when identical)."""
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} came back as {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, torch.nn.Parameter):
            same = same and a.requires_grad == b.requires_grad
        return [] if same else [f"{where}: tensor {a} != {b}"]
    if isinstance(a, np.ndarray):
        same = a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        return [] if same else [f"{where}: array {a!r} != {b!r}"]
    if isinstance(a, np.generic):
        return [] if a.dtype == b.dtype and a == b else [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, dict):
        if list(a.keys()) != list(b.keys()):
            return [f"{where}: keys {list(a)} != {list(b)}"]
        diffs = [d for k in a for d in _same(a[k], b[k], f"{where}[{k!r}]")]
        diffs += [d for ka, kb in zip(a, b) for d in _same(ka, kb, f"{where} key {ka!r}")]
        if isinstance(a, defaultdict) and a.default_factory is not b.default_factory:
            diffs.append(f"{where}: default_factory {a.default_factory} != {b.default_factory}")
        return diffs
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    if isinstance(a, (set, frozenset)):
        return [] if a == b and {type(x) for x in a} == {type(x) for x in b} else [f"{where}: {a} != {b}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _through_a_state_file(value):
    """``encode`` -> ``torch.save`` -> ``torch.load(weights_only=True)`` -> ``decode``."""
    buffer = io.BytesIO()
    torch.save(encode(value, "client_state"), buffer)
    buffer.seek(0)
    return decode(torch.load(buffer, weights_only=True), "client_state")


@pytest.mark.parametrize("name", sorted(_table()))
def test_each_value_round_trips_with_its_type(name):
    value = _table()[name]
    assert _same(value, _through_a_state_file(value)) == []
    nested = {"a": [value, {"b": (value,)}]}
    assert _same(nested, _through_a_state_file(nested)) == []


def test_encoding_twice_changes_nothing():
    """An asynchronous save copies the already encoded state again (``RankSnapshot.detached``)."""
    table = _table()
    once = encode(table, "client_state")
    buffer = io.BytesIO()
    torch.save(encode(once, "state"), buffer)
    buffer.seek(0)
    assert _same(table, decode(torch.load(buffer, weights_only=True))) == []


def _local_enum():
    class Local(enum.Enum):
        A = 1

    return Local.A


def _lambda_factory():
    return 0


@pytest.mark.parametrize(
    "value, where, says",
    [
        (lambda: 0, "client_state['v']", "holds a value of type function"),
        (defaultdict(lambda: 0), "client_state['v']", "default_factory"),
        (defaultdict(_lambda_factory), "client_state['v']", "default_factory"),
        (np.longdouble(1), "client_state['v']", "holds a numpy float"),
        (np.datetime64("2020-01-01"), "client_state['v']", "datetime64"),
        (np.array([object()]), "client_state['v']", "dtype object"),
        (type("MyDict", (dict,), {})(), "client_state['v']", "a dict subclass"),
        (
            torch.return_types.max((torch.ones(1), torch.zeros(1, dtype=torch.long))),
            "client_state['v']",
            "a tuple subclass",
        ),
        (_local_enum(), "client_state['v']", "defined inside a function"),
        ({"deep": [1, {"x": object()}]}, "client_state['v']['deep'][1]['x']", "holds a value of type object"),
    ],
)
def test_values_that_would_not_load_back_are_refused_at_save_naming_the_key(value, where, says):
    with pytest.raises(StateTypeError) as error:
        encode({"v": value}, "client_state")
    message = str(error.value)
    assert message.startswith(where + " ") and says in message and "\n" not in message
    assert isinstance(error.value, TypeError)


def test_loading_never_imports_a_module_and_calls_only_enums_and_namedtuples():
    missing = "zerotrain_test_not_a_module_xyz"
    node = {TAG: "enum", "cls": f"{missing}:Color", "value": 1}
    with pytest.raises(StateDecodeError, match=rf"import {missing} before load_checkpoint"):
        decode({"c": node}, "client_state")
    assert missing not in sys.modules
    # an importable, loaded callable that is not an Enum is never called
    for cls in ("os:system", "builtins:eval", "subprocess:Popen"):
        with pytest.raises(StateDecodeError, match="refusing to call it|not a namedtuple"):
            decode({TAG: "enum", "cls": cls, "value": "echo hi"})
        with pytest.raises(StateDecodeError, match="not a namedtuple"):
            decode({TAG: "namedtuple", "cls": cls, "fields": ["a"], "items": ["echo hi"]})
    # a namedtuple whose fields changed since the save
    with pytest.raises(StateDecodeError, match="fields"):
        decode({TAG: "namedtuple", "cls": f"{__name__}:Point", "fields": ["x", "z"], "items": [1, 2]})
    # numpy dtypes are checked before use
    with pytest.raises(StateDecodeError, match="not one a checkpoint stores"):
        decode({TAG: "numpy", "dtype": "|O", "value": 1})


# -- through save_checkpoint / load_checkpoint on 2 ranks ---------------------------------------


def _decay(step):
    return np.float64(0.9) ** step  # a numpy learning-rate factor: the lr becomes np.float64


def _config():
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000,
    }


def _engine():
    import zerotrain
    from tests.engine.workloads import make_model

    model = make_model()
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_config(),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _decay),
    )
    return engine


def _step(engine):
    from tests.engine.workloads import SEQ, TINY

    batch = torch.randint(0, TINY["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(batch, labels=batch).loss)
    engine.step()


def _save_and_load(root: str):
    import os

    import torch.distributed as dist

    from zerotrain.checkpoint.format import CheckpointError

    out = {}
    engine = _engine()
    for _ in range(3):
        _step(engine)
    table = _table()
    table["rank_dependent"] = np.int64(dist.get_rank())
    engine.save_checkpoint(root, tag="t", client_state=table)
    out["scheduler_saved"] = engine.lr_scheduler.state_dict()
    out["lr_saved"] = engine.optimizer.param_groups[0]["lr"]

    fresh = _engine()
    _, loaded = fresh.load_checkpoint(root, tag="t")
    expected = _table()
    expected["rank_dependent"] = np.int64(0)  # the client state of rank 0, as DeepSpeed
    out["client_diffs"] = _same(expected, loaded, "client_state")
    out["scheduler_diffs"] = _same(out["scheduler_saved"], fresh.lr_scheduler.state_dict(), "scheduler")
    out["lr_diffs"] = _same(out["lr_saved"], fresh.optimizer.param_groups[0]["lr"], "lr")
    _step(fresh)  # it trains on
    out["lr_after"] = fresh.optimizer.param_groups[0]["lr"]

    # refused at save on one rank only: every rank raises, the partial folder is gone, the
    # previous checkpoint stays the latest
    bad = {"ok": 1, "counts": defaultdict(lambda: 0)} if dist.get_rank() == 1 else {"ok": 1}
    for async_save in (False, True):
        try:
            engine.save_checkpoint(root, tag="bad", client_state=bad, async_save=async_save)
            engine.wait_for_checkpoint()
            out["refused", async_save] = "no error"
        except (TypeError, CheckpointError) as error:
            out["refused", async_save] = f"{type(error).__name__}: {error}"
    dist.barrier()
    out["after_refusal"] = sorted(os.listdir(root))
    out["latest"] = open(os.path.join(root, "latest")).read()

    # a deleted state file: CheckpointError naming it (not FileNotFoundError)
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(root, "t", "state.rank00000.pt"))
    dist.barrier()
    try:
        _engine().load_checkpoint(root, tag="t")
        out["missing"] = "no error"
    except Exception as error:  # noqa: BLE001 - the type is what is checked
        out["missing"] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("client_state")
    return root, run_on_ranks(_save_and_load, 2, args=(str(root / "ckpt"),), timeout=300)


def test_client_and_scheduler_state_load_back_equal_and_of_the_same_type(results):
    _, ranks = results
    for r in ranks:
        assert r["client_diffs"] == []
        assert r["scheduler_diffs"] == [] and r["lr_diffs"] == []
        assert type(r["lr_saved"]) is np.float64 and r["lr_saved"] == 1e-3 * np.float64(0.9) ** 3
        assert r["scheduler_saved"]["_last_lr"] == [r["lr_saved"]]
        assert r["lr_after"] == 1e-3 * np.float64(0.9) ** 4  # the resumed schedule goes on


def test_a_refused_value_fails_the_save_on_every_rank_naming_the_key(results):
    root, ranks = results
    for async_save in (False, True):
        refused = [r["refused", async_save] for r in ranks]
        assert refused[1].startswith(
            "StateTypeError: client_state['counts'] is a defaultdict whose default_factory is <function"
        ), refused[1]
        assert "\n" not in refused[1]
        assert refused[0].startswith("CheckpointError: checkpoint "), refused[0]
        assert "rank 1: client_state['counts'] is a defaultdict" in refused[0]
    for r in ranks:
        assert r["after_refusal"] == ["latest", "t", "zero_to_fp32.py", "zerotrain_checkpoint_format.py"]
        assert r["latest"] == "t"


def test_a_deleted_state_file_is_a_checkpoint_error_naming_it(results):
    root, ranks = results
    for r in ranks:
        assert r["missing"].startswith("CheckpointError: "), r["missing"]
        assert str(root / "ckpt" / "t" / "state.rank00000.pt") in r["missing"]
        assert "is missing" in r["missing"]
