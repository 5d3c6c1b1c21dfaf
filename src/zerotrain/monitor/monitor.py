"""``MonitorMaster``: the one object the engine calls once per optimizer step."""

from __future__ import annotations

import importlib.util
import weakref

# zerotrain.engine.timers' phase names (DeepSpeed's), in DeepSpeed's event order
_TIMER_EVENTS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")

#: config section -> ((master attribute, module, class), package it needs, extra that installs it)
_WRITERS = {
    "tensorboard": (
        ("tb_monitor", "zerotrain.monitor.tensorboard", "TensorBoardMonitor"),
        "tensorboard",
        "tensorboard",
    ),
    "csv_monitor": (("csv_monitor", "zerotrain.monitor.csv_monitor", "CSVMonitor"), None, None),
    "mlflow": (("mlflow_monitor", "zerotrain.monitor.mlflow", "MLflowMonitor"), "mlflow", "mlflow"),
    "wandb": (("wandb_monitor", "zerotrain.monitor.wandb", "WandbMonitor"), "wandb", "wandb"),
    "comet": (("comet_monitor", "zerotrain.monitor.comet", "CometMonitor"), "comet_ml", "comet"),
}


class Monitor:
    """A sink for ``(name, value, step)`` events."""

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        raise NotImplementedError

    def log_params(self, params: dict) -> None:
        """Run parameters (the config), once; MLflow, wandb and Comet record them."""

    def close(self) -> None:
        """Flush and release files/runs; safe to call more than once."""


def missing_extra(section: str, module: str, extra: str) -> ImportError | None:
    """An ImportError naming the extra to install when ``module`` is not importable, else None."""
    if importlib.util.find_spec(module) is not None:
        return None
    return ImportError(
        f'"{section}.enabled" needs the {module} package, which is not installed: pip install "zerotrain[{extra}]"'
    )


def config_params(config, world_size: int) -> dict:
    """The run's parameters: the config as the user wrote it (dotted keys), plus the resolved
    batch sizes and the world size."""
    flat: dict = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    walk(dict(getattr(config, "_raw", None) or {}), "")
    flat.update(
        train_batch_size=config.train_batch_size,
        train_micro_batch_size_per_gpu=config.train_micro_batch_size_per_gpu,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        world_size=world_size,
    )
    return flat


def _close_all(monitors: list) -> None:
    for monitor in monitors:
        try:
            monitor.close()
        except Exception:  # closing at exit must not mask the real error, if any
            pass


class MonitorMaster:
    """Every enabled monitor of the config, for one engine. ``enabled`` is the same on every rank
    (it decides whether ranks gather their hardware figures); only the first rank of the engine's
    data-parallel group holds writers (per-engine output: two engines on disjoint groups each
    write their own). Writers are flushed and closed by ``close()``, when the master is garbage
    collected, or at exit.

    ``topology`` is the engine's (``engine.topology``: the engine passes it); DeepSpeed's
    ``MonitorMaster(config)`` has no such argument, so without one the process's current topology
    (``zerotrain.topology.current()``, the last ``initialize``'s). ``rank``/``world_size`` override
    the data-parallel rank and size (a master outside any process group)."""

    def __init__(self, config, rank: int | None = None, world_size: int | None = None, topology=None):
        hardware_group, hardware_ranks = None, None
        if rank is None or world_size is None:
            if topology is None:
                from zerotrain.topology import current

                topology = current()
            hardware_group, hardware_ranks = topology.data_group, topology.axis_ranks("data")
        # "Rank 0" of the monitors: the engine's first data-parallel rank, not the job's.
        self.rank = topology.data_rank if rank is None else rank
        self.world_size = topology.data_size if world_size is None else world_size
        on = [(name, getattr(config, name)) for name in _WRITERS if getattr(config, name).enabled]
        self.enabled = bool(on)
        for name, _ in on:  # on every rank, so no rank goes on alone
            module, extra = _WRITERS[name][1:]
            if module and (error := missing_extra(name, module, extra)):
                raise error
        self.tb_monitor = self.csv_monitor = self.mlflow_monitor = None
        self.wandb_monitor = self.comet_monitor = None
        self.monitors: list[Monitor] = []
        self._hardware = None
        if self.enabled:
            from zerotrain.monitor.hardware import HardwareSampler

            self._hardware = HardwareSampler(hardware_group, hardware_ranks)
        if self.enabled and self.rank == 0:
            try:
                for name, cfg in on:
                    attribute, module_path, cls = _WRITERS[name][0]
                    writer = getattr(importlib.import_module(module_path), cls)(cfg)
                    setattr(self, attribute, writer)
                    self.monitors.append(writer)
            except BaseException:
                _close_all(self.monitors)
                raise
        self._finalizer = weakref.finalize(self, _close_all, list(self.monitors))
        if self.monitors:
            self.log_params(config_params(config, self.world_size))

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for monitor in self.monitors:
            monitor.write_events(events)

    def log_params(self, params: dict) -> None:
        for monitor in self.monitors:
            monitor.log_params(params)

    def close(self) -> None:
        self._finalizer()

    # -- what the engine reports after each optimizer step --------------------------------
    def write_step(self, engine, losses) -> None:
        """Events of the step just taken: loss, lr, loss scale, phase times (with
        ``wall_clock_breakdown``) and every rank's hardware figures, at ``global_samples``.
        Called on every rank of the engine (the hardware figures are gathered over its data
        group); only the group's first rank writes."""
        times = engine._timers.pop_step()
        hardware = self._hardware.gather(engine.device) if self._hardware is not None else None
        if not self.monitors:
            return
        import torch

        step = engine.global_samples
        events = []
        if losses:
            events.append(("Train/Samples/train_loss", float(torch.stack(losses).float().mean()), step))
        lrs = engine.get_lr()
        if lrs:
            events.append(("Train/Samples/lr", float(lrs[0]), step))
        if engine.config.fp16.enabled:
            events.append(("Train/Samples/loss_scale", float(engine.loss_scale), step))
        if engine._timers.enabled:
            for name in _TIMER_EVENTS:
                if name in times:
                    events.append((f"Train/Samples/elapsed_time_ms_{name}", times[name], step))
        if hardware is not None:
            events.extend(self._hardware.events(hardware, step))
        self.write_events(events)
