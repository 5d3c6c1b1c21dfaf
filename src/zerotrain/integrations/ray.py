"""Ray Train: run zerotrain inside ``ray.train.torch.TorchTrainer``.

Ray starts the workers and their process group; ``zerotrain.initialize`` in the training loop
reuses that group, so no launcher is involved. What this module adds is only what Ray does not
know about zerotrain: its checkpoints are sharded (every rank writes its part), so

- :func:`report` saves a zerotrain checkpoint from every rank into one fresh directory and hands
  it to ``ray.train.report`` (Ray copies it into the run's storage and keeps rank 0's metrics);
- :func:`load_checkpoint` restores the engine from ``ray.train.get_checkpoint()`` after Ray
  restarts the workers (``FailureConfig(max_failures=K)``) or on a resumed run;
- :func:`scaling_config` builds Ray's ``ScalingConfig`` with the worker count the ds_config's
  batch sizes imply (train_batch_size = micro batch x accumulation steps x workers).

The directory the ranks save into must be one directory that every worker sees: the local
temporary directory on a one-machine Ray cluster, a shared filesystem (``shared_dir=``) when the
workers are on several machines.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from typing import Any

try:
    import ray.train
    from ray.train import Checkpoint, ScalingConfig
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("zerotrain.integrations.ray needs Ray Train: pip install 'zerotrain[ray]'") from err

from zerotrain.comm.collectives import barrier
from zerotrain.comm.objects import broadcast_object

__all__ = ["report", "load_checkpoint", "scaling_config"]


def _shared_directory(topology, shared_dir: str | None) -> str:
    # The engine's first data-parallel rank names a fresh directory and tells the engine's other
    # ranks, so every rank of the engine saves into the same one.
    first = topology.is_first("data")
    name = tempfile.mkdtemp(prefix="zerotrain_ray_ckpt_", dir=shared_dir) if first else None
    if topology.data_size > 1:
        name = broadcast_object(name, src=topology.first_global_rank("data"), group=topology.data_group)
    return name


def report(engine, metrics: dict[str, Any], shared_dir: str | None = None, client_state: dict | None = None) -> None:
    """Save a zerotrain checkpoint and report it with ``metrics`` to Ray. Call it on every worker.

    Every rank of the engine writes its shard into one fresh directory under ``shared_dir``
    (default: the system temporary directory; it must be visible to all workers); the engine's
    first data-parallel rank reports the checkpoint, the others report ``metrics`` alone (Ray
    keeps its rank 0's). The directory is removed once Ray has copied it into the run's storage.
    """
    # "Rank 0" here is the engine's first data-parallel rank (engine.topology): the rank that
    # names the directory, hands it to Ray and removes it; with one engine over Ray's whole
    # group it is Ray's rank 0.
    topology = engine.topology
    first = topology.is_first("data")
    directory = _shared_directory(topology, shared_dir)
    try:
        engine.save_checkpoint(directory, client_state=client_state or {})
        _barrier(topology)
        checkpoint = Checkpoint.from_directory(directory) if first else None
        ray.train.report(metrics, checkpoint=checkpoint)
        _barrier(topology)
    finally:
        if first:
            shutil.rmtree(directory, ignore_errors=True)


def _barrier(topology) -> None:
    if topology.data_size > 1:
        barrier(group=topology.data_group)


def load_checkpoint(engine, **kwargs: Any):
    """Restore ``engine`` from the checkpoint Ray hands this run (``ray.train.get_checkpoint()``):
    the latest one reported before a restart, or the one given to resume from. Returns
    ``engine.load_checkpoint``'s ``(path, client_state)``, or None when there is none (a fresh start)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return engine.load_checkpoint(directory, **kwargs)


def _read_config(config: str | dict) -> dict:
    if isinstance(config, dict):
        return config
    with open(config) as f:
        return json.load(f)


def scaling_config(
    config: str | dict, num_workers: int | None = None, use_gpu: bool | None = None, **kwargs: Any
) -> ScalingConfig:
    """Ray's ``ScalingConfig`` for a ds_config (dict or JSON path).

    ``num_workers`` defaults to ``train_batch_size / (train_micro_batch_size_per_gpu *
    gradient_accumulation_steps)`` (all three must be numbers then); ``use_gpu`` defaults to
    whether this machine has CUDA. Other keyword arguments go to ``ScalingConfig`` unchanged.
    """
    values = _read_config(config)
    if num_workers is None:
        batch, micro = values.get("train_batch_size"), values.get("train_micro_batch_size_per_gpu")
        accumulation = values.get("gradient_accumulation_steps", 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (batch, micro, accumulation)):
            raise ValueError(
                "scaling_config: give num_workers, or a config whose train_batch_size, "
                "train_micro_batch_size_per_gpu and gradient_accumulation_steps are numbers "
                f"(got {batch!r}, {micro!r}, {accumulation!r})"
            )
        if batch % (micro * accumulation):
            raise ValueError(
                f"scaling_config: train_batch_size {batch} is not a multiple of "
                f"train_micro_batch_size_per_gpu * gradient_accumulation_steps = {micro * accumulation}"
            )
        num_workers = batch // (micro * accumulation)
    if use_gpu is None:
        import torch

        use_gpu = torch.cuda.is_available()
    return ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, **kwargs)
