"""Reading a DeepSpeed checkpoint folder without running DeepSpeed's (or anyone's) code.

DeepSpeed's files are ``torch.save`` pickles. They are loaded with
``torch.load(..., weights_only=True)``, which rebuilds only tensors, containers and numbers,
plus an explicit allow-list of the few other types DeepSpeed 0.1x pickles. For DeepSpeed's own
classes a minimal stand-in is registered under DeepSpeed's module path for the duration of one
load, so neither DeepSpeed nor any other code is imported or run while unpickling (the same
classes are used whether DeepSpeed is installed or not). A file naming any other type is
refused before it is unpickled, with a message naming the type.

Layout of a DeepSpeed checkpoint (``save_dir/latest`` names the tag)::

    <tag>/mp_rank_00_model_states.pt                        stages 0-2: module, counters, ...
    <tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt       stage 3: one per data-parallel rank
    <tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  ZeRO: rank r's optimizer partition
"""

from __future__ import annotations

import argparse
import enum
import re
from pathlib import Path

import torch

from zerotrain.checkpoint.format import CheckpointError


class ZeroStageEnum(int, enum.Enum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class LossScaler:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler``: an attribute bag
    (``cur_scale``, ``dynamic``)."""


class DynamicLossScaler(LossScaler):
    """Stand-in for DeepSpeed's ``DynamicLossScaler`` (``cur_scale``, ``cur_iter``,
    ``last_overflow_iter``, ``cur_hysteresis``, ``scale_factor``, ``scale_window``, ...)."""


class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""


# What a DeepSpeed 0.1x checkpoint may hold besides what weights_only loading always accepts.
ALLOWED = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "argparse.Namespace": argparse.Namespace,  # Megatron-style `args` in the client state
}

_OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
# A MoE checkpoint's per-expert files (DeepSpeed's _get_expert_ckpt_name) and per-expert-parallel-
# rank optimizer files (the optimizer at ZeRO stage 0; {'optimizer': None} at ZeRO 1-2).
_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPP_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def safe_load(path: Path):
    """``torch.load(path, weights_only=True)`` allowing only DeepSpeed's own few types (as
    stand-ins); any other pickled type raises ``CheckpointError`` naming it."""
    if not hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):
        raise CheckpointError(
            f"reading DeepSpeed's pickles safely needs torch >= 2.6 (this is "
            f"{torch.__version__}): upgrade torch to convert {path}"
        )
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as error:  # noqa: BLE001 - not a torch.save zip file, truncated, ...
        raise CheckpointError(f"{path} is not a readable torch.save file: {error}") from None
    refused = sorted(set(found) - set(ALLOWED))
    if refused:
        raise CheckpointError(
            f"{path} holds pickled objects of type {', '.join(refused)}, which a DeepSpeed "
            "checkpoint does not contain; refusing to load it (unpickling could run arbitrary "
            f"code). Allowed besides tensors and containers: {', '.join(sorted(ALLOWED))}"
        )
    with torch.serialization.safe_globals([(cls, name) for name, cls in ALLOWED.items()]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - name the file, whatever went wrong
            raise CheckpointError(f"{path} cannot be loaded safely: {error}") from None


def plain(value, where: str):
    """``value`` with the stand-ins and ``Namespace`` turned into numbers and dicts."""
    if isinstance(value, enum.Enum):
        return int(value.value)
    if isinstance(value, (argparse.Namespace, LossScaler, FragmentAddress)):
        value = dict(vars(value))
    if isinstance(value, dict):
        return {k: plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


class DeepSpeedFolder:
    """The files of one DeepSpeed checkpoint tag, by kind and rank."""

    def __init__(self, checkpoint_dir, tag: str | None = None):
        root = Path(checkpoint_dir)
        if not root.is_dir():
            raise CheckpointError(f"{root} is not a folder")
        if tag is None and any(_MODEL_FILE.match(p.name) for p in root.iterdir()):
            self.folder, self.tag = root, root.name  # the tag folder itself
        else:
            if tag is None:
                latest = root / "latest"
                if not latest.is_file():
                    raise CheckpointError(
                        f"{latest} does not exist: pass --tag (e.g. global_step100) "
                        f"or the tag folder itself; {root} holds "
                        f"{sorted(p.name for p in root.iterdir())[:10]}"
                    )
                tag = latest.read_text().strip()
            self.folder, self.tag = root / tag, tag
        if not self.folder.is_dir():
            raise CheckpointError(f"DeepSpeed checkpoint {self.folder} does not exist")
        names = sorted(p.name for p in self.folder.iterdir())
        self.model_files: dict[int, Path] = {}
        self.optim_files: dict[int, Path] = {}
        self.expert_files: dict[tuple[int, int], Path] = {}  # (MoE layer, global expert id) -> file
        self.expp_files: dict[int, Path] = {}
        self.bf16_names = False
        for name in names:
            if (m := _EXPERT_FILE.match(name)) is not None:
                self._check_mp(int(m.group(3)), name)
                self.expert_files[(int(m.group(1)), int(m.group(2)))] = self.folder / name
            elif (m := _EXPP_FILE.match(name)) is not None:
                self._check_mp(int(m.group(2)), name)
                self.expp_files[int(m.group(1))] = self.folder / name
            elif (m := _OPTIM_FILE.match(name)) is not None:
                self._check_mp(int(m.group(3)), name)
                self.optim_files[int(m.group(2))] = self.folder / name
                self.bf16_names |= m.group(1) is not None
            elif (m := _MODEL_FILE.match(name)) is not None:
                self._check_mp(int(m.group(2)), name)
                self.model_files[int(m.group(1) or 0)] = self.folder / name
            elif name.startswith(("layer_", "expert_")):
                raise CheckpointError(
                    f"{self.folder / name}: pipeline-parallel (layer_XX-model_states.pt) checkpoints and "
                    "DeepSpeed's old mixture-of-experts layout (expert_E_mp_rank_XX) cannot be converted; "
                    "only data-parallel ZeRO checkpoints, with or without MoE layers, can"
                )
        if 0 not in self.model_files:
            raise CheckpointError(
                f"{self.folder} holds no mp_rank_00_model_states.pt (nor "
                f"zero_pp_rank_0_mp_rank_00_model_states.pt): not a DeepSpeed "
                f"checkpoint tag folder (it holds {names[:10]})"
            )
        if self.optim_files and sorted(self.optim_files) != list(range(len(self.optim_files))):
            raise CheckpointError(
                f"{self.folder}: optimizer files of ranks {sorted(self.optim_files)}: some ranks' files are missing"
            )

    def _check_mp(self, mp_rank: int, name: str) -> None:
        if mp_rank != 0:
            raise CheckpointError(
                f"{self.folder / name}: a tensor/model-parallel checkpoint (mp_rank {mp_rank}); "
                "only data-parallel checkpoints (mp_rank_00 alone) can be converted"
            )

    def model_states(self, rank: int = 0) -> dict:
        return self._dict(self.model_files[rank])

    def optim_states(self, rank: int) -> dict:
        """Rank ``rank``'s optimizer file's ``optimizer_state_dict``."""
        path = self.optim_files[rank]
        state = self._dict(path)
        if "optimizer_state_dict" not in state:
            raise CheckpointError(f"{path} has no 'optimizer_state_dict': not a DeepSpeed ZeRO optimizer file")
        return state["optimizer_state_dict"]

    @staticmethod
    def _dict(path: Path) -> dict:
        state = safe_load(path)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a DeepSpeed state dict")
        return state
