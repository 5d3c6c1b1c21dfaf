"""CSV monitor (DeepSpeed's format): one file per event under ``output_path/job_name``, named
after the event with ``/`` and spaces replaced by ``_`` (``Train_Samples_train_loss.csv``), with
the header ``step,<last part of the event name>``. Files are appended to; the header is written
when a file is new or empty."""

from __future__ import annotations

import csv
import os

from zerotrain.monitor.monitor import Monitor


class CSVMonitor(Monitor):
    def __init__(self, config):
        self.log_dir = os.path.join(config.output_path, config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._files: dict[str, tuple] = {}

    def _writer(self, name: str):
        entry = self._files.get(name)
        if entry is None:
            filename = name.replace("/", "_").replace(" ", "_")
            path = os.path.join(self.log_dir, filename + ".csv")
            handle = open(path, "a", newline="")
            writer = csv.writer(handle)
            if handle.tell() == 0:
                writer.writerow(["step", name.split("/")[-1]])
            entry = self._files[name] = (handle, writer)
        return entry

    def write_events(self, events) -> None:
        handles = set()
        for name, value, step in events:
            handle, writer = self._writer(name)
            writer.writerow([step, value])
            handles.add(handle)
        for handle in handles:
            handle.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files = {}
