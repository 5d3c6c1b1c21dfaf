"""Weights & Biases monitor (DeepSpeed's ``wandb`` section).

The first data rank calls ``wandb.init(project=project, group=group, entity=team)``, as DeepSpeed
does, unless the script already started a run (``wandb.run``): then the events go into that run
and it is left open. Each step's events are one ``run.log({...}, step=global_samples)``. Without
network, ``WANDB_MODE=offline`` keeps the run in ``$WANDB_DIR/wandb/offline-run-*`` for a later
``wandb sync``.
"""

from __future__ import annotations

from zerotrain.monitor.monitor import Monitor


class WandbMonitor(Monitor):
    def __init__(self, config):
        import wandb

        if wandb.run is not None:
            self.run, self._owns_run = wandb.run, False
        else:
            self.run = wandb.init(project=config.project, group=config.group, entity=config.team)
            self._owns_run = True

    def log_params(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def write_events(self, events) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(int(step), {})[name] = float(value)
        for step, values in by_step.items():
            self.run.log(values, step=step)

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None and self._owns_run:
            run.finish()
