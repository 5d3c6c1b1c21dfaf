"""DeepSpeed's ``deepspeed.runtime.zero`` module path (``offload_config``, ``partition_parameters``,
``stage3``, ``stage_1_and_2``); zerotrain's ZeRO implementation lives in ``zerotrain.zero``.

As in DeepSpeed (where ``deepspeed.zero`` is this package), ``Init``, ``GatheredParameters`` and
``ZeroParamStatus`` are names here too; everything loads on first access.
"""

from zerotrain._lazy import lazy_attributes

SUBMODULES = ("offload_config", "partition_parameters", "stage3", "stage_1_and_2")

__getattr__, __dir__ = lazy_attributes(
    __name__,
    SUBMODULES,
    names={
        "Init": "zerotrain.zero",
        "GatheredParameters": "zerotrain.zero",
        "ZeroParamStatus": "zerotrain.zero.param_status",
    },
)
