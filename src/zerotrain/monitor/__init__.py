"""Training monitors (DeepSpeed's ``tensorboard``, ``csv_monitor``, ``wandb``, ``comet`` and our
``mlflow`` sections) and the FLOPs profiler (``flops``).

``MonitorMaster`` is built by the engine from the config; it writes on global rank 0 only, with
DeepSpeed's event names (``Train/Samples/train_loss`` ...) and ``global_samples`` as the x axis.
TensorBoard, MLflow, wandb and Comet are optional extras (``pip install "zerotrain[tensorboard]"``,
``"zerotrain[mlflow]"``, ``[wandb]``, ``[comet]``), imported only when their section is enabled.
"""

from zerotrain._lazy import lazy_attributes
from zerotrain.monitor.monitor import Monitor, MonitorMaster, missing_extra

__all__ = ["Monitor", "MonitorMaster", "missing_extra"]

# DeepSpeed-named submodules, attributes as after ``import deepspeed`` (loaded on first access;
# none imports its optional extra until a monitor is built).
__getattr__, __dir__ = lazy_attributes(__name__, ("csv_monitor", "tensorboard", "wandb", "comet"))
