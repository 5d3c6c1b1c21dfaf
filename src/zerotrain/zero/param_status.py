"""``ZeroParamStatus``: where a stage-3 parameter's data is, as its ``ds_status`` says (DeepSpeed's
enum and values; ``deepspeed.runtime.zero.partition_parameters`` re-exports it).

Scripts compare a stage-3 parameter's ``ds_status`` with ``ZeroParamStatus.NOT_AVAILABLE`` to
decide which parameters to gather.
"""

from __future__ import annotations

from enum import Enum


class ZeroParamStatus(Enum):
    """Where a ZeRO-3 parameter's data is (DeepSpeed's values)."""

    AVAILABLE = 1  # whole on this rank, ready to use
    NOT_AVAILABLE = 2  # partitioned: only this rank's shard is here
    INFLIGHT = 3  # being gathered
