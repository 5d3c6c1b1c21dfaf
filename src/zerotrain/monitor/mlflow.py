"""MLflow monitor (zerotrain's own ``mlflow`` section).

The tracking URI is ``mlflow.tracking_uri``, else the ``MLFLOW_TRACKING_URI`` environment
variable, else MLflow's default; the experiment is ``experiment_name``, else
``MLFLOW_EXPERIMENT_NAME``/``MLFLOW_EXPERIMENT_ID``, else MLflow's default experiment. When rank 0
already has an active MLflow run (the script called ``mlflow.start_run()``) and the section names
no run, metrics go to that run and it is left open; otherwise a run is created (named
``run_name``) and ended when the monitor closes. Parameters are logged once, metrics every step:
asynchronously where MLflow supports it, with at most one step's batch in flight (a step waits
for the previous step's batch), so a slow tracking server delays training by at most its excess
over one step.
"""

from __future__ import annotations

import os
import time

from zerotrain.monitor.monitor import Monitor

_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_VALUE = 500


class MLflowMonitor(Monitor):
    def __init__(self, config):
        import mlflow
        from mlflow.tracking import MlflowClient

        self.tracking_uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        active = mlflow.active_run()
        if active is not None and config.run_name is None and config.tracking_uri is None:
            self.run_id, self._owns_run = active.info.run_id, False
        else:
            experiment_id = self._experiment_id(config.experiment_name)
            run = self.client.create_run(experiment_id, run_name=config.run_name)
            self.run_id, self._owns_run = run.info.run_id, True
        self._async = True
        self._pending = None
        self._closed = False

    def _experiment_id(self, name: str | None) -> str:
        name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name:
            experiment = self.client.get_experiment_by_name(name)
            return experiment.experiment_id if experiment else self.client.create_experiment(name)
        return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(str(k), str(v)[:_MAX_PARAM_VALUE]) for k, v in params.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + _MAX_PARAMS_PER_BATCH])

    def write_events(self, events) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, float(value), now, int(step)) for name, value, step in events]
        self._wait()
        if self._async:
            try:
                self._pending = self.client.log_batch(self.run_id, metrics=metrics, synchronous=False)
                return
            except TypeError:  # MLflow without async logging
                self._async = False
        self.client.log_batch(self.run_id, metrics=metrics)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wait()
        if self._owns_run:
            self.client.set_terminated(self.run_id)
