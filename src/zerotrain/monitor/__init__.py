"""Training monitors (DeepSpeed's ``tensorboard``, ``csv_monitor`` and our ``mlflow`` sections).

``MonitorMaster`` is built by the engine from the config; it writes on global rank 0 only, with
DeepSpeed's event names (``Train/Samples/train_loss`` ...) and ``global_samples`` as the x axis.
TensorBoard and MLflow are optional extras (``pip install "zerotrain[tensorboard]"``,
``"zerotrain[mlflow]"``), imported only when their section is enabled.
"""

from zerotrain._lazy import lazy_attributes
from zerotrain.monitor.monitor import Monitor, MonitorMaster, missing_extra

__all__ = ["Monitor", "MonitorMaster", "missing_extra"]

# DeepSpeed-named submodules, attributes as after ``import deepspeed`` (loaded on first access;
# neither imports its optional extra until a monitor is built).
__getattr__, __dir__ = lazy_attributes(__name__, ("csv_monitor", "tensorboard"))
