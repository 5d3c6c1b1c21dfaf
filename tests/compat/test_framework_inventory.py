"""The DeepSpeed names that training frameworks reach (``framework_inventory.json``) are where
zerotrain says they are.

The inventory (regenerated from the clients' sources by ``scan_framework_sources.py``) lists
each name with the files and lines that use it, and a status:

- ``supported``: the name exists on zerotrain as the client reaches it: a ``deepspeed.*`` path
  resolves through the DeepSpeed alias (``zerotrain.hf.use_zerotrain_as_deepspeed``) by attribute
  access from ``import deepspeed``; an ``engine.*`` chain on an engine that trained one step at
  the entry's ZeRO stage; ``param.ds_*`` on one of its parameters and ``module.ds_*`` on its
  module (stage 3); and a callable takes every keyword argument the clients pass it
  (``keywords``: ``save_checkpoint(..., exclude_frozen_parameters=...)``);
- ``refused``: with a ``reason``; the name is checked to be absent (or to raise when read), so
  the list stays true as names are added: adding one fails here until its entry is flipped.

One 2-rank group builds the stage-2 and stage-3 engines and reads every name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zerotrain.testing import run_on_ranks

INVENTORY = json.loads((Path(__file__).parent / "framework_inventory.json").read_text())
ENTRIES = INVENTORY["names"]

#: kind -> the prefix its names start with (the object the chain is read on).
KIND_PREFIX = {
    "module name": "deepspeed",
    "engine attr": "engine.",
    "optimizer attr": "engine.optimizer.",
    "param attr": "param.ds_",
    "module attr": "module.ds_",
}
WHERE = re.compile(r"^[\w./-]+\.py:\d+$")


def test_inventory_entries_are_well_formed():
    names = [entry["name"] for entry in ENTRIES]
    assert len(names) == len(set(names)), "a name is listed twice"
    bad = []
    for entry in ENTRIES:
        name, kind, status = entry["name"], entry.get("kind"), entry.get("status")
        if kind not in KIND_PREFIX or not name.startswith(KIND_PREFIX[kind]):
            bad.append(f"{name}: kind {kind!r} does not match the name")
        if status not in ("supported", "refused"):
            bad.append(f"{name}: status {status!r} (a regenerated entry is 'new' until someone judges it)")
        if status == "refused" and not entry.get("reason", "").strip():
            bad.append(f"{name}: refused without a reason")
        if (kind == "module name") == ("stage" in entry):
            bad.append(f"{name}: a stage belongs to attribute entries only")
        if not entry.get("clients"):
            bad.append(f"{name}: no client uses it")
        for use in entry.get("clients", ()):
            if INVENTORY["clients"].get(use["client"]) != f"{use['client']}=={use['version']}":
                bad.append(f"{name}: {use} names a client version the inventory does not list")
            if not WHERE.match(use["where"]):
                bad.append(f"{name}: where {use['where']!r} is not file.py:line")
    assert bad == []


def _read_chain(root, parts, keywords=()):
    """``root.parts[0].parts[1]...``; ``None`` when every read succeeds and the object takes the
    keyword arguments the clients pass it, else what failed."""
    import inspect

    obj = root
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except Exception as exc:  # a refused name may raise anything naming itself
            return f"{'.'.join(parts[: i + 1])}: {type(exc).__name__}: {exc}"
    if keywords:
        parameters = inspect.signature(obj).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            refused = sorted(set(keywords) - set(parameters))
            if refused:
                return f"{'.'.join(parts)} takes no keyword argument {refused}"
    return None


def _read_names(entries):
    """Each entry's name read on zerotrain as its clients read it: {name: None or the failure},
    and what the clients do with a few of them (``facts``)."""
    import torch

    import zerotrain.hf

    zerotrain.hf.use_zerotrain_as_deepspeed()
    import deepspeed

    from tests.engine.workloads import adamw_config, global_batches, make_model

    found = {}
    for entry in entries:
        if entry["kind"] == "module name":
            parts = entry["name"].split(".")[1:]
            found[entry["name"]] = _read_chain(deepspeed, parts, entry.get("keywords", ()))
    by_stage = {}
    for entry in entries:
        if entry["kind"] != "module name":
            by_stage.setdefault(entry["stage"], []).append(entry)
    runtime, partition_parameters = deepspeed.runtime, deepspeed.runtime.zero.partition_parameters
    facts = {  # TRL's type hint, OpenRLHF's version check, transformers' arange wrapper
        "runtime.engine.DeepSpeedEngine": runtime.engine.DeepSpeedEngine is deepspeed.DeepSpeedEngine,
        "version": deepspeed.version == deepspeed.__version__,
        "partition_parameters.get_accelerator": partition_parameters.get_accelerator()
        is deepspeed.accelerator.get_accelerator(),
    }
    data = global_batches(1, 4)[0]
    for stage, stage_entries in sorted(by_stage.items()):
        config = adamw_config(2, zero_optimization={"stage": stage})
        engine, optimizer, _, _ = deepspeed.initialize(model=make_model(), config=config)
        # Lightning's load_checkpoint finds the optimizer in a state by this test.
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

        facts[f"stage {stage}: optimizer is an Optimizer or DeepSpeedOptimizer"] = isinstance(
            optimizer, (torch.optim.Optimizer, DeepSpeedOptimizer)
        )
        rank = engine.get_data_parallel_rank()
        batch = data[2 * rank : 2 * rank + 2]
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()
        roots = {"engine": engine, "param": next(engine.module.parameters()), "module": engine.module}
        for entry in stage_entries:
            owner, *parts = entry["name"].split(".")
            found[entry["name"]] = _read_chain(roots[owner], parts, entry.get("keywords", ()))
        engine.destroy()
    return found, facts


def test_inventory_statuses_hold_on_zerotrain():
    (found, facts), other_rank = run_on_ranks(_read_names, 2, args=(ENTRIES,))
    assert (found, facts) == other_rank
    assert [what for what, holds in facts.items() if not holds] == []
    wrong = []
    for entry in ENTRIES:
        failure = found[entry["name"]]
        if entry["status"] == "supported" and failure is not None:
            wrong.append(f"supported but missing: {failure}")
        elif entry["status"] == "refused" and failure is None:
            wrong.append(f"refused ({entry['reason']}) but present: {entry['name']} (flip it to supported)")
    assert wrong == []


@pytest.mark.parametrize("kind", sorted(KIND_PREFIX))
def test_every_kind_has_entries(kind):
    # So that a scan that lost a whole kind (a changed pattern) shows up here.
    assert any(entry["kind"] == kind for entry in ENTRIES)
