"""Comet monitor (DeepSpeed's ``comet`` section).

The first data rank starts an experiment with ``comet_ml.start(api_key, project, workspace,
experiment_key, mode, online)`` and names it ``experiment_name``. ``online: false`` writes an
offline experiment (a zip under ``COMET_OFFLINE_DIRECTORY``, for ``comet upload``); it needs no
network and no API key. As in DeepSpeed, an event is logged the first time it is seen and then
again once ``samples_log_interval`` samples have passed since it was last logged (x axis:
global samples).
"""

from __future__ import annotations

from zerotrain.monitor.monitor import Monitor


class CometMonitor(Monitor):
    def __init__(self, config):
        import comet_ml

        self.experiment = comet_ml.start(
            api_key=config.api_key,
            project=config.project,
            workspace=config.workspace,
            experiment_key=config.experiment_key,
            mode=config.mode,
            online=config.online,
        )
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self.samples_log_interval = config.samples_log_interval
        self._last_logged: dict[str, int] = {}

    def _due(self, name: str, samples: int) -> bool:
        last = self._last_logged.get(name)
        if last is not None and samples - last < self.samples_log_interval:
            return False
        self._last_logged[name] = samples
        return True

    def log_params(self, params: dict) -> None:
        self.experiment.log_parameters(params)

    def write_events(self, events) -> None:
        for name, value, step in events:
            if self._due(name, int(step)):
                self.experiment.log_metric(name, float(value), step=int(step))

    def close(self) -> None:
        experiment, self.experiment = self.experiment, None
        if experiment is not None:
            experiment.end()
