"""What ``zerotrain.checkpointing.configure`` sets, and where each option comes from.

One process-wide :class:`Settings` (DeepSpeed keeps module globals). ``configure`` starts from
the defaults, applies ``deepspeed_config``'s ``activation_checkpointing`` section, then the
explicit arguments (an argument given overrides the config), checks the combination and logs
it on rank 0. ``initialize`` applies a config's section the same way when the config has one
and no ``configure`` call came first (DeepSpeed's engine never does; there the section is read
only by ``configure(deepspeed_config=...)``, so scripts that call it see the same result).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zerotrain.log import log_rank0


@dataclasses.dataclass(frozen=True)
class Settings:
    """The active options (DeepSpeed's argument names)."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False
    mpu: Any = None
    configured: bool = False  # set by configure() (or by initialize from a config section)
    by_user: bool = False  # set by an explicit configure() call


_current = Settings()


def current() -> Settings:
    """The active settings."""
    return _current


def is_configured() -> bool:
    """True once ``configure`` ran (or ``initialize`` applied a config's
    ``activation_checkpointing`` section), as DeepSpeed's ``is_configured``."""
    return _current.configured


def configure(
    mpu_=None,
    deepspeed_config=None,
    partition_activations=None,
    contiguous_checkpointing=None,
    num_checkpoints=None,
    checkpoint_in_cpu=None,
    synchronize=None,
    profile=None,
) -> None:
    """Configure ``zerotrain.checkpointing.checkpoint`` (DeepSpeed's ``deepspeed.checkpointing.configure``).

    - ``mpu_``: a model-parallel unit. zerotrain is data-parallel only: an mpu whose
      (tensor-)model-parallel world size is above 1 raises ``NotImplementedError``; otherwise
      it is kept for the RNG tracker's rank.
    - ``deepspeed_config``: a config dict, JSON path or loaded ``ZeroTrainConfig``; its
      ``activation_checkpointing`` section gives the values the other arguments do not.
    - ``partition_activations``: DeepSpeed splits each saved checkpoint input across the
      model-parallel ranks. Without model parallelism there is nothing to split it across (one
      rank keeps the whole input, as DeepSpeed does with a model-parallel size of 1): accepted,
      no effect, logged.
    - ``contiguous_checkpointing`` (+ ``num_checkpoints``): DeepSpeed copies those partitions into
      one pre-allocated buffer per checkpoint to avoid fragmentation; it needs
      ``partition_activations`` and ``num_checkpoints`` (ValueError otherwise, as DeepSpeed
      asserts) and, like it, has nothing to arrange without model parallelism: no effect, logged.
    - ``checkpoint_in_cpu``: the inputs each checkpoint saves for its recomputation are kept in
      host memory and moved back to the accelerator device for the recomputation.
    - ``synchronize``: ``get_accelerator().synchronize()`` at the start and end of each
      checkpointed forward and of each recomputation.
    - ``profile``: logs each checkpointed forward's and each recomputation's time (rank 0) and
      adds them to ``profile_totals()``.
    """
    global _current
    values: dict[str, Any] = {}
    if deepspeed_config is not None:
        values.update(section_values(deepspeed_config))
    given = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    values.update({k: v for k, v in given.items() if v is not None})
    settings = _checked(Settings(mpu=_checked_mpu(mpu_), configured=True, by_user=True, **values))
    _current = settings
    _log(settings)


def configure_from_engine_config(cfg) -> None:
    """``initialize``'s hook: apply ``cfg.activation_checkpointing`` when the config has that
    section and no explicit ``configure`` call came first (an explicit call wins, as in
    DeepSpeed, where the engine never applies the section; a differing section is then logged)."""
    global _current
    if "activation_checkpointing" not in cfg.model_fields_set:
        return
    settings = _checked(Settings(configured=True, **section_values(cfg)))
    if _current.by_user:
        mine = dataclasses.replace(_current, mpu=None, configured=True, by_user=False)
        if mine != settings:
            log_rank0(
                "zerotrain.checkpointing: keeping the options of the earlier configure() call; "
                "the config's activation_checkpointing section differs and is not applied"
            )
        return
    _current = settings
    _log(settings)


def reset() -> None:
    """DeepSpeed's ``reset``: drops buffers that checkpointed forwards left for a backward that
    never came (evaluation). zerotrain keeps no buffers outside autograd's graph, so nothing is
    left to drop; the options stay as configured."""


def _unconfigure_for_tests() -> None:
    """Back to the state of a fresh process (not DeepSpeed API)."""
    global _current
    _current = Settings()


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's setter for ``partition_activations`` alone (checked like ``configure``)."""
    global _current
    _current = _checked(dataclasses.replace(_current, partition_activations=bool(partition_activation)))


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's setter for ``num_checkpoints`` alone."""
    global _current
    _current = _checked(dataclasses.replace(_current, num_checkpoints=nlayers))


def section_values(config) -> dict[str, Any]:
    """The ``activation_checkpointing`` section of a config dict, JSON path or ZeroTrainConfig,
    validated, as ``Settings`` field values."""
    from pydantic import ValidationError

    from zerotrain.config.errors import config_error, from_validation_error
    from zerotrain.config.load import read_config
    from zerotrain.config.schema import ActivationCheckpointingConfig

    section = getattr(config, "activation_checkpointing", None)
    if section is None:
        raw = read_config(config).get("activation_checkpointing") or {}
        try:
            section = ActivationCheckpointingConfig.model_validate(raw)
        except ValidationError as exc:
            problems = from_validation_error(exc, ActivationCheckpointingConfig).problems
            raise config_error([f"activation_checkpointing.{line}" for line in problems]) from None
    return {
        "partition_activations": section.partition_activations,
        "contiguous_checkpointing": section.contiguous_memory_optimization,
        "num_checkpoints": section.number_checkpoints or None,
        "checkpoint_in_cpu": section.cpu_checkpointing,
        "synchronize": section.synchronize_checkpoint_boundary,
        "profile": section.profile,
    }


def _checked_mpu(mpu):
    if mpu is None:
        return None
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        size = getattr(mpu, name, None)
        if size is not None and int(size()) > 1:
            raise NotImplementedError(
                f"zerotrain.checkpointing.configure(mpu_=...): {name}() is {size()}; activation "
                "partitioning across model-parallel ranks needs tensor/model parallelism, which "
                "zerotrain does not have (it is data-parallel only). Pass mpu_=None."
            )
    return mpu


def _checked(settings: Settings) -> Settings:
    n = settings.num_checkpoints
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"zerotrain.checkpointing: num_checkpoints must be a positive integer, got {n!r}")
    if settings.contiguous_checkpointing and not settings.partition_activations:
        raise ValueError(
            "zerotrain.checkpointing: contiguous_checkpointing "
            "(activation_checkpointing.contiguous_memory_optimization) needs "
            "partition_activations=True, as in DeepSpeed"
        )
    if settings.contiguous_checkpointing and n is None:
        raise ValueError(
            "zerotrain.checkpointing: contiguous_checkpointing needs num_checkpoints "
            "(activation_checkpointing.number_checkpoints), as in DeepSpeed"
        )
    return settings


def _log(settings: Settings) -> None:
    notes = []
    if settings.partition_activations:
        notes.append(
            "partition_activations has no effect without model parallelism (each rank "
            "keeps its whole checkpoint inputs, as DeepSpeed does with model-parallel size 1)"
        )
    if settings.contiguous_checkpointing:
        notes.append("contiguous_checkpointing has no effect without partitioned activations to arrange")
    log_rank0(
        "zerotrain.checkpointing: checkpoint_in_cpu=%s synchronize=%s profile=%s num_checkpoints=%s%s",
        settings.checkpoint_in_cpu,
        settings.synchronize,
        settings.profile,
        settings.num_checkpoints,
        "".join(f"; {note}" for note in notes),
    )
