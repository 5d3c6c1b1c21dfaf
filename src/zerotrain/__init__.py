"""zerotrain: memory-efficient distributed training for PyTorch with a DeepSpeed-compatible API.

A DeepSpeed script runs after ``import zerotrain as deepspeed``::

    engine, optimizer, dataloader, lr_scheduler = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    for batch in dataloader:
        loss = engine(batch["input_ids"], labels=batch["labels"]).loss
        engine.backward(loss)
        engine.step()
"""

__version__ = "0.1.0"

from zerotrain import comm  # noqa: E402  (``zerotrain.comm`` mirrors ``deepspeed.comm``)
from zerotrain.comm.distributed import init_distributed  # noqa: E402
from zerotrain.config import add_config_arguments  # noqa: E402
from zerotrain.engine import ZeroTrainEngine, initialize  # noqa: E402

# DeepSpeed's class name, for code that checks isinstance(engine, deepspeed.DeepSpeedEngine).
DeepSpeedEngine = ZeroTrainEngine

__all__ = ["initialize", "init_distributed", "add_config_arguments", "ZeroTrainEngine",
           "DeepSpeedEngine", "comm", "__version__"]
