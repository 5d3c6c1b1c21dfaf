"""``deepspeed.runtime.pipe.schedule``'s path. zerotrain runs torch's schedules
(``torch.distributed.pipelining``), not DeepSpeed's instruction generators (``TrainSchedule``,
``InferenceSchedule`` and their instructions do not exist here); this re-exports the adapter
(zerotrain.pipeline.schedule) and the names of the schedules offered (docs/pipeline.md)."""

from zerotrain.pipeline.schedule import DEFAULT_SCHEDULE, SCHEDULES, StageRunner

__all__ = ["SCHEDULES", "DEFAULT_SCHEDULE", "StageRunner"]
