"""``deepspeed.utils.logging`` under its DeepSpeed path: the logger and ``log_dist``.

Lightning's DeepSpeed strategy sets this logger's level (``deepspeed.utils.logging.logger.setLevel``)
when it is built. A re-export of :mod:`zerotrain.log`."""

from zerotrain.log import log_dist, logger  # noqa: F401

__all__ = ["logger", "log_dist"]
