"""TensorBoard monitor: scalars in ``output_path/job_name`` (DeepSpeed's layout)."""

from __future__ import annotations

import os

from zerotrain.monitor.monitor import Monitor


class TensorBoardMonitor(Monitor):
    def __init__(self, config):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(config.output_path, config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events, flush: bool = True) -> None:
        if self.summary_writer is None:
            return
        for name, value, step in events:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def close(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.close()
            self.summary_writer = None
