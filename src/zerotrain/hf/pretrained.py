"""``HfZeroConfig``: transformers' ``HfDeepSpeedConfig`` without the ``deepspeed`` package.

Fine-tuning scripts make ``from_pretrained`` build and load a model already partitioned for
ZeRO-3 by creating ``HfDeepSpeedConfig(ds_config)`` (and keeping it alive) before the call.
transformers' class insists on the DeepSpeed package; this one registers the same config with
transformers, and makes the ``import deepspeed`` that ``from_pretrained`` then does resolve to
zerotrain, so the one-line change is::

    dschf = HfDeepSpeedConfig(ds_config)          # before
    dschf = zerotrain.hf.HfZeroConfig(ds_config)  # after (keep the object alive, as before)
    model = AutoModelForCausalLM.from_pretrained(path)  # partitioned while loading

Under the switch (``python -m zerotrain.hf ...`` / ``use_zerotrain_as_deepspeed()``)
transformers' own ``HfDeepSpeedConfig`` works unchanged; ``HfZeroConfig`` also works where the
switch is off or came too late (transformers already imported), because ``from_pretrained``
reads this config at call time.
"""

from __future__ import annotations

import sys

from accelerate.utils.deepspeed import HfDeepSpeedConfig as _AccelerateDeepSpeedConfig


class HfZeroConfig(_AccelerateDeepSpeedConfig):
    """A ds_config (dict, JSON path or base64 JSON) that transformers' ``from_pretrained`` and
    ``is_deepspeed_zero3_enabled()`` see, as with ``HfDeepSpeedConfig``.

    With ``zero_optimization.stage`` 3, ``from_pretrained`` then builds the model inside
    ``zerotrain.zero.Init`` (each module partitioned as its constructor returns) and loads the
    checkpoint module by module (each module's parameters gathered, filled on rank 0 and
    partitioned again), so no rank ever holds the whole model. transformers keeps only a weak
    reference: keep this object alive while models are loaded. The process group is started
    (``zerotrain.init_distributed``) at the first partitioning, from the launcher's environment.
    """

    def __init__(self, config_file_or_dict):
        _alias_deepspeed_to_zerotrain()
        super().__init__(config_file_or_dict)
        from transformers.integrations import deepspeed as hf_deepspeed

        hf_deepspeed.set_hf_deepspeed_config(self)


def _alias_deepspeed_to_zerotrain() -> None:
    """``import deepspeed`` -> zerotrain's alias in this process (not its children).

    Unlike the switch this needs no package metadata and may come after transformers was
    imported: ``from_pretrained`` imports ``deepspeed`` when it runs."""
    from zerotrain.hf.deepspeed_alias import DeepSpeedAliasModule, become_deepspeed

    current = sys.modules.get("deepspeed")
    if current is not None and not isinstance(current, DeepSpeedAliasModule):
        raise RuntimeError(
            f"the real DeepSpeed is imported ({getattr(current, '__file__', current)}); "
            "use transformers' HfDeepSpeedConfig with it, or zerotrain.hf.HfZeroConfig "
            "in a process that does not import deepspeed"
        )
    become_deepspeed()
