"""``deepspeed.runtime.utils``: ``memory_status``, ``see_memory_usage`` (zerotrain.monitor.memory)
and ``set_random_seed`` (zerotrain.seeding) under DeepSpeed's path."""

from zerotrain.accelerator.cpu import peak_rss_bytes
from zerotrain.monitor.memory import memory_status, see_memory_usage
from zerotrain.seeding import set_random_seed

__all__ = ["memory_status", "see_memory_usage", "set_random_seed", "peak_rss_bytes"]
