"""``deepspeed.utils.timer.ThroughputTimer``: samples per second over optimizer steps
(implemented in ``zerotrain.engine.timers``)."""

from zerotrain.engine.timers import ThroughputTimer

__all__ = ["ThroughputTimer"]
