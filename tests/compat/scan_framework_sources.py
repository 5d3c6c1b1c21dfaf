"""Regenerate the name/where part of ``framework_inventory.json`` from the clients' sources.

The inventory lists every DeepSpeed name that training frameworks built on DeepSpeed reach (module
paths and attributes under ``deepspeed``, and the engine / optimizer / parameter attributes their
DeepSpeed code paths touch), each with the files and lines that use it. This script downloads
the clients' wheels with pip (so it needs a package index and is not run by the tests), reads
them with ``ast`` and rewrites the ``clients`` lists of the inventory, keeping each entry's
``kind``/``status``/``reason``/``note``/``stage`` (a new name gets ``status: "new"`` for a person
to judge; the test refuses that status, so a regeneration cannot pass unreviewed). Each entry
also gets the keyword arguments the clients pass it, which the test checks signatures against.
Files a run never executes (the clients' shipped test helpers, transformers' ``modular_*.py``)
are skipped.

Run from the repository root::

    python tests/compat/scan_framework_sources.py              # download into /tmp/framework-sources
    python tests/compat/scan_framework_sources.py --sources DIR --no-download

(A fresh download reproduces the committed file exactly; the client versions are pinned in
``CLIENTS`` below, DeepSpeed's in ``DEEPSPEED``.)

What counts as a use:

- ``deepspeed`` names, found with ``ast``: ``import deepspeed[.x] [as y]``, ``from deepspeed.x
  import y [as z]``, ``importlib.import_module("deepspeed.x")``, and the longest attribute chain
  rooted at a name those bound (``deepspeed.comm.get_rank()`` is ``deepspeed.comm.get_rank``;
  ``from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus`` then
  ``ZeroParamStatus.NOT_AVAILABLE`` is ``...ZeroParamStatus.NOT_AVAILABLE``).
- ``ds_*`` attributes that DeepSpeed itself sets on parameters or modules (``param.ds_numel``,
  ``module.ds_external_parameters``): any attribute access of such a name counts, whatever the
  receiver is called, because the names are DeepSpeed's alone.
- Engine and ZeRO-optimizer attributes: an attribute of DeepSpeed's engine
  (``DeepSpeedEngine``'s methods and the ``self.X`` it assigns) read on a receiver whose name says
  it is an engine (``engine``, ``model_engine``, ``ds_engine``, ``self.deepspeed_engine`` ...), and
  the chain below ``<engine>.optimizer``. Receivers with a generic name (``model``,
  ``self.model``) are too ambiguous for a scan; ``REVIEWED`` lists those found by reading the
  clients' DeepSpeed code, each located again by a pattern on its line.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

INVENTORY = Path(__file__).with_name("framework_inventory.json")

#: client -> (PyPI requirement, package folder inside the unpacked wheel).
CLIENTS = {
    "trl": ("trl==1.16.0", "trl"),
    "accelerate": ("accelerate==1.15.0", "accelerate"),
    "transformers": ("transformers==5.24.0", "transformers"),
    "lightning": ("lightning==2.6.6", "lightning"),
    "openrlhf": ("openrlhf==0.11.2", "openrlhf-0.11.2.data/purelib/openrlhf"),
    "llamafactory": ("llamafactory==0.9.5", "llamafactory"),
    "axolotl": ("axolotl==0.19.0", "axolotl"),
    "verl": ("verl==0.9.1", "verl"),
}
DEEPSPEED = "deepspeed==0.19.8"

#: Files a training run does not execute: the clients' own test helpers shipped in their wheels
#: (accelerate's test_utils scripts, transformers' testing_utils) and transformers' modular_*.py
#: (templates its modeling_*.py files are generated from).
TEST_HELPERS = re.compile(
    r"(^|/)(test_utils|testing|tests)/|(^|/)testing_utils\.py$|(^|/)modular_\w+\.py$"
)  # read for its engine/optimizer/parameter attribute names

#: A receiver named like DeepSpeed's engine: ``engine``, ``model_engine``, ``ds_engine``,
#: ``deepspeed_engine``, alone or as the last attribute (``self.deepspeed_engine_wrapped.engine``).
#: ``self._deepspeed_engine`` (LlamaFactory's plugin object) and ``vllm_engine`` are not.
ENGINE_RECEIVER = re.compile(r"^(\w+\.)*(engine|model_engine|ds_engine|deepspeed_engine)$")


# -- download -------------------------------------------------------------------------------


def download(requirement: str, dest: Path) -> Path:
    """Unpack ``requirement``'s wheel (or sdist) into ``dest/<name>``; the folder."""
    name = requirement.split("==")[0]
    folder = dest / name
    if folder.is_dir() and any(folder.iterdir()):
        return folder
    archives = dest / "archives"
    archives.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(archives), requirement], check=True
    )
    version = requirement.split("==")[1]
    stem = name.replace("-", "_")
    (archive,) = [p for p in archives.iterdir() if p.name.lower().startswith(f"{stem}-{version}".lower())]
    folder.mkdir(parents=True, exist_ok=True)
    if archive.suffix == ".whl":
        zipfile.ZipFile(archive).extractall(folder)
    else:
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
    return folder


# -- DeepSpeed's own attribute names ----------------------------------------------------------


def _class_members(tree: ast.Module, class_name: str) -> set[str]:
    members: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif (
                    isinstance(item, ast.Attribute)
                    and isinstance(item.ctx, ast.Store)
                    and isinstance(item.value, ast.Name)
                    and item.value.id == "self"
                ):
                    members.add(item.attr)
    return members


def deepspeed_attribute_names(root: Path) -> dict[str, set[str]]:
    """``engine``: DeepSpeedEngine's members; ``ds_attrs``: every ``x.ds_*`` DeepSpeed assigns."""
    package = next(root.rglob("deepspeed/runtime/engine.py")).parents[1]
    engine = _class_members(ast.parse((package / "runtime/engine.py").read_text()), "DeepSpeedEngine")
    engine.add("module")  # set through self.__dict__, which the walk above does not see
    ds_attrs: set[str] = set()
    for path in package.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("ds_") and isinstance(node.ctx, ast.Store):
                ds_attrs.add(node.attr)
            elif isinstance(node, ast.FunctionDef) and node.name.startswith("ds_"):
                ds_attrs.add(node.name)  # methods DeepSpeed attaches (module.ds_external_parameters)
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "setattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("ds_")
            ):
                ds_attrs.add(node.args[1].value)
    return {"engine": engine, "ds_attrs": ds_attrs}


# -- the clients' uses ------------------------------------------------------------------------


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; calls and subscripts inside end the chain (None)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def _outermost_attributes(tree: ast.Module):
    """Attribute nodes that are not the ``.value`` of another attribute (the whole chain)."""
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and id(node) not in inner]


def _deepspeed_bindings(tree: ast.Module) -> dict[str, str]:
    """Local names bound to deepspeed objects by imports anywhere in the file."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "deepspeed" or alias.name.startswith("deepspeed."):
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["deepspeed"] = "deepspeed"
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and (node.module == "deepspeed" or node.module.startswith("deepspeed."))
        ):
            for alias in node.names:
                if alias.name != "*":
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _keywords(node: ast.AST, calls: dict[int, ast.Call]) -> tuple[str, ...]:
    """The keyword arguments ``node`` is called with (``x.save_checkpoint(d, tag=t)`` -> ("tag",))."""
    call = calls.get(id(node))
    return tuple(k.arg for k in call.keywords if k.arg) if call is not None else ()


def scan_file(path: Path, ds_names: dict[str, set[str]]):
    """Yield (name, kind, line, keyword arguments) for every use in one file."""
    try:
        text = path.read_text()
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError):
        return
    bound = _deepspeed_bindings(tree)
    calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    # Engine/optimizer receivers count only in code that deals with DeepSpeed at all (verl's
    # own "engine" classes are not DeepSpeed's).
    deepspeed_code = "deepspeed" in text.lower()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "deepspeed" or alias.name.startswith("deepspeed."):
                    yield alias.name, "module name", node.lineno, ()
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and bound
            and (node.module == "deepspeed" or node.module.startswith("deepspeed."))
        ):
            for alias in node.names:
                yield f"{node.module}.{alias.name}", "module name", node.lineno, ()
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("deepspeed")
        ):
            yield node.args[0].value, "module name", node.lineno, ()
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in bound:
            yield bound[node.func.id], "module name", node.lineno, _keywords(node.func, calls)
    for node in _outermost_attributes(tree):
        chain = _chain(node)
        if chain and chain[0] in bound and isinstance(node.ctx, ast.Load):
            yield ".".join([bound[chain[0]], *chain[1:]]), "module name", node.lineno, _keywords(node, calls)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in ds_names["ds_attrs"]:
            yield from _ds_attribute(node.attr, node.lineno)
            continue
        chain = _chain(node)
        if not chain:
            continue
        receiver = ".".join(chain[:-1])
        if deepspeed_code and ENGINE_RECEIVER.match(receiver) and chain[-1] in ds_names["engine"]:
            yield f"engine.{chain[-1]}", "engine attr", node.lineno, _keywords(node, calls)
    for node in ast.walk(tree):  # hasattr(p, "ds_numel"), getattr(p, "ds_id", None)
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") in ("hasattr", "getattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in ds_names["ds_attrs"]
        ):
            yield from _ds_attribute(node.args[1].value, node.lineno)
    for node in _outermost_attributes(tree) if deepspeed_code else ():
        chain = _chain(node)
        if not chain:
            continue
        for i in range(1, len(chain) - 1):
            if ENGINE_RECEIVER.match(".".join(chain[:i])) and chain[i] == "optimizer":
                yield (
                    "engine.optimizer." + ".".join(chain[i + 1 :]),
                    "optimizer attr",
                    node.lineno,
                    _keywords(node, calls),
                )
                break


#: ``ds_*`` names DeepSpeed sets on modules (any other is a parameter's).
MODULE_DS_ATTRS = {"ds_external_parameters", "ds_grads_remaining", "ds_model_granularity"}


def _ds_attribute(attr: str, line: int):
    kind = "module attr" if attr in MODULE_DS_ATTRS else "param attr"
    owner = "module" if kind == "module attr" else "param"
    yield f"{owner}.{attr}", kind, line, ()


def _reviewed_uses(client: str, root: Path):
    """REVIEWED entries for ``client``, each located by its pattern (must match exactly once...
    or at every line it names)."""
    for name, kind, entries in REVIEWED:
        for entry_client, rel, pattern in entries:
            if entry_client != client:
                continue
            text = (root / rel).read_text()
            hits = [i + 1 for i, line in enumerate(text.splitlines()) if re.search(pattern, line)]
            if not hits:
                raise SystemExit(f"reviewed use {name!r} no longer found in {client} {rel} ({pattern!r})")
            method = name.rsplit(".", 1)[1]
            for line in hits:
                keywords = {
                    k.arg
                    for node in ast.walk(ast.parse(text))
                    if isinstance(node, ast.Call) and node.lineno == line and getattr(node.func, "attr", None) == method
                    for k in node.keywords
                    if k.arg
                }
                yield name, kind, rel, line, tuple(keywords)


def scan(sources: Path, download_missing: bool) -> dict[str, dict]:
    ds_root = download(DEEPSPEED, sources) if download_missing else sources / "deepspeed"
    ds_names = deepspeed_attribute_names(ds_root)
    found: dict[str, dict] = {}

    def add(name, kind, client, version, where, keywords):
        entry = found.setdefault(name, {"name": name, "kind": kind, "clients": [], "keywords": set()})
        entry["keywords"].update(keywords)
        use = {"client": client, "version": version, "where": where}
        if use not in entry["clients"]:
            entry["clients"].append(use)

    for client, (requirement, package) in CLIENTS.items():
        folder = download(requirement, sources) if download_missing else sources / requirement.split("==")[0]
        version = requirement.split("==")[1]
        root = folder / package
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent).as_posix()
            if TEST_HELPERS.search(rel):
                continue
            for name, kind, line, keywords in scan_file(path, ds_names):
                add(name, kind, client, version, f"{rel}:{line}", keywords)
        for name, kind, rel, line, keywords in _reviewed_uses(client, root.parent):
            add(name, kind, client, version, f"{rel}:{line}", keywords)
    return found


# Uses on receivers the scan cannot tell apart from non-DeepSpeed objects, found by reading the
# clients' DeepSpeed code paths: (name, kind, [(client, file, regex on the line)]).
# The patterns are anchored on the client's own spelling; a pattern that stops matching after a
# version bump stops the scan (a person re-reads that code).
_TRL_HOOKS = "trl/models/utils.py"  # remove_hooks/add_hooks around generation under ZeRO-3
_ACC = "accelerate/accelerator.py"
_HF = "transformers/trainer.py"
_ORLHF = "openrlhf/utils/deepspeed/deepspeed.py"  # `model` is the engine (Actor.model unwrapped)
_ORLHF_UTILS = "openrlhf/utils/deepspeed/deepspeed_utils.py"
REVIEWED: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("engine.optimizer", "engine attr", [("trl", _TRL_HOOKS, r"model\.optimizer is not None and hasattr")]),
    (
        "engine.optimizer.parameter_offload",
        "optimizer attr",
        [("trl", _TRL_HOOKS, r"model\.optimizer\.parameter_offload")],
    ),
    (
        "engine.optimizer.parameter_offload.module",
        "optimizer attr",
        [("trl", _TRL_HOOKS, r"optimizer_offload\.module\b")],
    ),
    (
        "engine.optimizer.parameter_offload.forward_hooks",
        "optimizer attr",
        [("trl", _TRL_HOOKS, r"optimizer_offload\.forward_hooks")],
    ),
    (
        "engine.optimizer.parameter_offload.backward_hooks",
        "optimizer attr",
        [("trl", _TRL_HOOKS, r"optimizer_offload\.backward_hooks")],
    ),
    (
        "engine.optimizer.parameter_offload.param_coordinator",
        "optimizer attr",
        [("trl", _TRL_HOOKS, r"optimizer_offload\.param_coordinator|\"param_coordinator\"")],
    ),
    (
        "engine.optimizer.parameter_offload.param_coordinator.is_invalid_trace",
        "optimizer attr",
        [("trl", _TRL_HOOKS, r"coordinator\.is_invalid_trace\(")],
    ),
    (
        "engine.optimizer.parameter_offload.param_coordinator._invalidate_trace",
        "optimizer attr",
        [("trl", _TRL_HOOKS, r"coordinator\._invalidate_trace\(")],
    ),
    (
        "engine.optimizer.parameter_offload._register_deepspeed_module",
        "optimizer attr",
        [("trl", _TRL_HOOKS, r"optimizer_offload\._register_deepspeed_module")],
    ),
    (
        "engine.optimizer.overflow",
        "optimizer attr",
        [
            (
                "accelerate",
                "accelerate/utils/deepspeed.py",
                r"self\.optimizer\.overflow|hasattr\(self\.optimizer, \"overflow\"\)",
            )
        ],
    ),
    (
        "engine.module",
        "engine attr",
        [
            ("accelerate", "accelerate/utils/other.py", r"^        model = model\.module$"),
            ("openrlhf", _ORLHF, r"return model\.module$"),
            ("openrlhf", "openrlhf/trainer/ray/ppo_actor.py", r"self\.actor\.model\.module"),
        ],
    ),
    (
        "engine.save_checkpoint",
        "engine attr",
        [
            ("accelerate", _ACC, r"model\.save_checkpoint\(output_dir, ckpt_id"),
            ("transformers", _HF, r"self\.model_wrapped\.save_checkpoint"),
            ("openrlhf", _ORLHF, r"model\.save_checkpoint\(save_dir"),
        ],
    ),
    (
        "engine.load_checkpoint",
        "engine attr",
        [
            ("accelerate", _ACC, r"model\.load_checkpoint\(input_dir, ckpt_id"),
            ("openrlhf", _ORLHF, r"= model\.load_checkpoint\("),
        ],
    ),
    (
        "engine.zero_gather_16bit_weights_on_model_save",
        "engine attr",
        [("accelerate", _ACC, r"model\.zero_gather_16bit_weights_on_model_save\(\)")],
    ),
    (
        "engine._zero3_consolidated_16bit_state_dict",
        "engine attr",
        [
            ("accelerate", _ACC, r"model\._zero3_consolidated_16bit_state_dict\(\)"),
            ("transformers", _HF, r"self\.deepspeed\._zero3_consolidated_16bit_state_dict"),
        ],
    ),
    (
        "engine._consolidated_16bit_state_dict",
        "engine attr",
        [
            ("accelerate", _ACC, r"model\._consolidated_16bit_state_dict\(\)"),
            ("openrlhf", _ORLHF, r"model\._consolidated_16bit_state_dict\(\)"),
        ],
    ),
    (
        "engine.config",
        "engine attr",
        [
            ("transformers", _HF, r"self\.deepspeed\.config\.get"),
            ("openrlhf", _ORLHF_UTILS, r"model\.config\[\"zero_optimization\"\]"),
        ],
    ),
    (
        "engine.backward",
        "engine attr",
        [
            ("lightning", "lightning/fabric/plugins/precision/deepspeed.py", r"model\.backward\(tensor"),
            ("openrlhf", _ORLHF, r"^        model\.backward\(loss\)"),
        ],
    ),
    ("engine.step", "engine attr", [("openrlhf", _ORLHF, r"^        model\.step\(\)")]),
    # Fabric steps the optimizer deepspeed.initialize returned, not the engine.
    (
        "engine.optimizer.step",
        "optimizer attr",
        [("lightning", "lightning/fabric/plugins/precision/deepspeed.py", r"return optimizer\.step\(\*\*kwargs\)")],
    ),
    ("engine.get_global_grad_norm", "engine attr", [("openrlhf", _ORLHF, r"model\.get_global_grad_norm\(\)")]),
    (
        "engine.zero_optimization_stage",
        "engine attr",
        [("openrlhf", _ORLHF_UTILS, r"model\.zero_optimization_stage\(\)")],
    ),
    (
        "engine.optimizer.offload_states",
        "optimizer attr",
        [("openrlhf", _ORLHF_UTILS, r"model\.optimizer\.offload_states\(")],
    ),
    ("engine.empty_partition_cache", "engine attr", [("openrlhf", _ORLHF_UTILS, r"model\.empty_partition_cache\(\)")]),
    ("engine.reload_states", "engine attr", [("openrlhf", _ORLHF_UTILS, r"model\.reload_states\(")]),
]


ENTRY_KEYS = ("name", "kind", "stage", "status", "reason", "note", "keywords", "clients")


def _where_key(where: str):
    path, _, line = where.rpartition(":")
    return path, int(line)


def dump(data: dict) -> str:
    """JSON with one line per use (the file stays readable in a diff)."""
    text = json.dumps(data, indent=1)
    return (
        re.sub(r'\{\s+("client": "[^"]*"),\s+("version": "[^"]*"),\s+("where": "[^"]*")\s+\}', r"{\1, \2, \3}", text)
        + "\n"
    )


def default_stage(name: str, kind: str) -> int:
    """The ZeRO stage whose engine the test reads an attribute on: 3 for what exists only there
    (parameter and module ``ds_*`` attributes, the parameter-offload facade), else 2."""
    return 3 if kind in ("param attr", "module attr") or ".parameter_offload" in name else 2


def merge(found: dict[str, dict], previous: dict[str, dict]) -> list[dict]:
    entries = []
    for name in sorted(found):
        entry = dict(found[name])
        entry["keywords"] = sorted(entry["keywords"])
        if not entry["keywords"]:
            del entry["keywords"]
        old = previous.get(name, {})
        for key in ("kind", "status", "reason", "note", "stage"):
            if key in old:
                entry[key] = old[key]
        entry.setdefault("status", "new")
        if entry["kind"] != "module name":
            entry.setdefault("stage", default_stage(entry["name"], entry["kind"]))
        entry["clients"] = sorted(entry["clients"], key=lambda u: (u["client"], _where_key(u["where"])))
        entries.append({key: entry[key] for key in ENTRY_KEYS if key in entry})
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=Path, default=Path("/tmp/framework-sources"))
    parser.add_argument("--no-download", action="store_true", help="use the unpacked folders in --sources")
    parser.add_argument("--out", type=Path, default=INVENTORY)
    args = parser.parse_args()
    previous = {}
    if args.out.exists():
        previous = {e["name"]: e for e in json.loads(args.out.read_text())["names"]}
    found = scan(args.sources, not args.no_download)
    data = {"clients": {c: r for c, (r, _) in CLIENTS.items()}, "deepspeed": DEEPSPEED, "names": merge(found, previous)}
    args.out.write_text(dump(data))
    print(f"{len(data['names'])} names written to {args.out}")


if __name__ == "__main__":
    main()
