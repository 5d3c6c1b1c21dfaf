"""The ``"pipeline"`` section: DeepSpeed's keys (``get_pipeline_config``) plus zerotrain's
``schedule``. It matters only when the model is a ``PipelineModule`` (docs/pipeline.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator

from .fields import NonNegInt, PosInt, Section, lower


class PipelineConfig(Section):
    """DeepSpeed parses ``stages``, ``partition`` and ``seed_layers`` and ignores them (users set
    them on ``PipelineModule``); ``pipe_partitioned``/``grad_partitioned`` only act with tensor
    parallelism, which zerotrain has not; ``activation_checkpoint_interval`` (> 0) and
    ``use_reentrant`` are applied to the module. ``schedule`` (zerotrain) picks torch's schedule;
    ``virtual_stages`` (zerotrain), when set, must equal the module's ``virtual_stages``."""

    stages: Literal["auto"] | PosInt = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: NonNegInt = 0
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True
    # zerotrain: time each stage's forward/backward per batch (busy/idle per stage; off: no cost).
    timeline: bool = False
    schedule: Annotated[
        Literal["1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev"],
        BeforeValidator(lower),
    ] = "1f1b"
    # zerotrain: model chunks per pipeline rank; "auto" takes PipelineModule(virtual_stages=).
    virtual_stages: Literal["auto"] | PosInt = "auto"
