"""Spark: ``DeepspeedTorchDistributor`` with pyspark's constructor, running zerotrain.

    from zerotrain.integrations.spark import DeepspeedTorchDistributor

    distributor = DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False,
                                            deepspeedConfig={"train_micro_batch_size_per_gpu": 4, ...})
    result = distributor.run(train_fn, arg1)                 # rank 0's return value
    distributor.run("train.py", "--var1", "value1")          # script gets --deepspeed --deepspeed_config PATH

Built on ``pyspark.ml.torch.distributor.TorchDistributor`` (its barrier-mode Spark job, master
address/port exchange and log streaming); each Spark task (local mode: the driver) runs
``zerotrain launch``, i.e. torch's elastic agent, instead of torchrun. Differences from pyspark's
own DeepspeedTorchDistributor: the value of global rank 0 is returned every time; a failing
script or function raises with the failing rank's report; CPU (``useGpu=False``, gloo) works;
the executors' Python must be able to import zerotrain (checked, with the setting to change);
asking more processes than the cluster has task slots fails at once; the temporary config file
is removed. A script gets ``--deepspeed --deepspeed_config PATH`` (no ``--local_rank``; read
``LOCAL_RANK`` from the environment, as with pyspark); a function finds the path in the
``ZEROTRAIN_DEEPSPEED_CONFIG`` environment variable.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

try:
    from pyspark.ml.torch.distributor import TorchDistributor
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("zerotrain.integrations.spark needs pyspark: pip install 'zerotrain[spark]'") from err

from zerotrain.integrations.function_runner import CONFIG_ENV

__all__ = ["DeepspeedTorchDistributor", "CONFIG_ENV"]

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "function_runner.py")
_REPORT = re.compile(r"zerotrain: rank \d+ \(pid \d+\).*failed with.*")


class DeepspeedTorchDistributor(TorchDistributor):
    """Run a zerotrain (DeepSpeed-style) training script or function on Spark.

    Args:
        numGpus: processes per node (per Spark task with ``localMode=False`` on GPUs).
        nnodes: nodes; ``numGpus * nnodes`` processes in all.
        localMode: True runs every process on the driver; False runs one barrier Spark task per
            node (per process on CPU) on the executors.
        useGpu: False trains on CPU with gloo.
        deepspeedConfig: a ds_config dict (written to a temporary file, removed afterwards) or
            the path of a JSON file readable where the processes run; None passes none.
    """

    _DEEPSPEED_SSL_CONF = "deepspeed.spark.distributor.ignoreSsl"

    def __init__(
        self,
        numGpus: int = 1,
        nnodes: int = 1,
        localMode: bool = True,
        useGpu: bool = True,
        deepspeedConfig: str | dict[str, Any] | None = None,
    ):
        for name, value in (("numGpus", numGpus), ("nnodes", nnodes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DeepspeedTorchDistributor: {name} must be a positive int, got {value!r}")
        if deepspeedConfig is not None and not isinstance(deepspeedConfig, (str, dict)):
            raise TypeError(
                "DeepspeedTorchDistributor: deepspeedConfig must be a dict, a JSON file path or None, "
                f"got {type(deepspeedConfig).__name__}"
            )
        if isinstance(deepspeedConfig, dict):
            json.dumps(deepspeedConfig)  # fail here, not on a node, if it cannot be written as JSON
        self.deepspeed_config = deepspeedConfig
        super().__init__(numGpus * nnodes, localMode, useGpu, _ssl_conf=self._DEEPSPEED_SSL_CONF)

    # --- checks on the driver -------------------------------------------------------------
    def _task_slots(self) -> int:
        sc = self.spark.sparkContext
        try:
            jsc = sc._jsc.sc()
            return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
        except Exception:  # noqa: BLE001 - an internal API; fall back to the public estimate
            return sc.defaultParallelism // int(sc.getConf().get("spark.task.cpus", "1"))

    def _wait_for_slots(self, timeout: float = 30.0, settle: float = 3.0) -> int:
        # Executors register after the session starts: wait until there are enough slots, or the
        # count has stayed the same (and non-zero) for `settle` seconds, or `timeout` passed.
        deadline, slots, since = time.monotonic() + timeout, -1, time.monotonic()
        while True:
            now_slots = self._task_slots()
            if now_slots != slots:
                slots, since = now_slots, time.monotonic()
            if slots >= self.num_tasks or time.monotonic() > deadline or (slots and time.monotonic() - since > settle):
                return slots
            time.sleep(0.2)

    def _check_cluster(self) -> None:
        if self.local_mode or self.is_remote:
            return
        conf = self.spark.sparkContext.getConf()
        if conf.get("spark.dynamicAllocation.enabled", "false").lower() != "true":
            slots = self._wait_for_slots()
            if self.num_tasks > slots:
                raise RuntimeError(
                    f"DeepspeedTorchDistributor: {self.num_tasks} barrier task(s) needed (numGpus * nnodes) but the "
                    f"cluster runs {slots} task(s) at once; Spark would wait for slots that never come. Use fewer "
                    "processes or add executors/cores"
                )
        python = getattr(self.spark.sparkContext, "pythonExec", None)
        if python and python != sys.executable and shutil.which(python) != sys.executable:
            self.logger.warning(
                f"executors run Python {python!r}, not the driver's {sys.executable!r}; it must "
                f"import zerotrain and torch (set PYSPARK_PYTHON={sys.executable} before creating "
                "the SparkSession to use the driver's)"
            )

    def _explain_failure(self, err: Exception) -> Exception:
        text = str(err)
        reports = _REPORT.findall(text)
        if re.search(r"No module named '(zerotrain|torch)'", text):
            python = getattr(self.spark.sparkContext, "pythonExec", "python3")
            return RuntimeError(
                f"DeepspeedTorchDistributor: the executors' Python ({python}) cannot import "
                f"zerotrain/torch; set PYSPARK_PYTHON (or spark.pyspark.python) to an interpreter "
                f"that has them, e.g. the driver's {sys.executable}, before creating the SparkSession"
            )
        if reports:
            return RuntimeError(
                "DeepspeedTorchDistributor: training failed: " + reports[0].split("\\n")[0] + "\n" + _tail_of(text)
            )
        return err

    def run(self, train_object: Callable | str, *args: Any, **kwargs: Any) -> Any:
        """Run a script (``args`` are its command-line strings) or a function (called with
        ``args``/``kwargs`` on every rank); return global rank 0's return value (None for a
        script). Raises RuntimeError naming the failing rank when any rank fails."""
        if isinstance(train_object, str) and kwargs:
            raise ValueError(
                "DeepspeedTorchDistributor.run: a script takes command-line strings, not keyword "
                f"arguments ({', '.join(kwargs)})"
            )
        self._check_cluster()
        try:
            if isinstance(train_object, str):
                return self._run(train_object, _run_script, *args)
            return self._run(train_object, _run_script, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised with the rank's report when there is one
            better = self._explain_failure(err)
            if better is err:
                raise
            raise better from err

    def _run(self, train_object, run_pytorch_file_fn, *args, **kwargs):
        # A function goes through zerotrain's runner (rank 0 alone writes the result), not
        # pyspark's, whose every rank overwrites the same output file.
        if isinstance(train_object, str):
            framework_wrapper_fn = run_pytorch_file_fn
        else:
            framework_wrapper_fn = _run_function
        if self.local_mode:
            return self._run_local_training(framework_wrapper_fn, train_object, run_pytorch_file_fn, *args, **kwargs)
        return self._run_distributed_training(
            framework_wrapper_fn, train_object, run_pytorch_file_fn, None, *args, **kwargs
        )


def _tail_of(text: str, lines: int = 12) -> str:
    return "\n".join(text.replace("\\n", "\n").splitlines()[-lines:])


@contextlib.contextmanager
def _config_path(config: str | dict | None) -> Iterator[str | None]:
    """A dict goes to a temporary JSON file on this node, removed afterwards."""
    if not isinstance(config, dict):
        yield config
        return
    fd, path = tempfile.mkstemp(prefix="zerotrain_ds_config_", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        yield path
    finally:
        os.unlink(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(
    input_params: dict[str, Any], train_path: str, args: list[str], config_path: str | None
) -> list[str]:
    """``zerotrain launch`` for this node: all processes here (local mode), or node RANK of the
    Spark barrier job (pyspark's task set MASTER_ADDR/MASTER_PORT/RANK and the rendezvous id)."""
    command = [sys.executable, "-m", "zerotrain.launcher.cli", "launch", "--no_local_rank"]
    if input_params["local_mode"]:
        command += ["--nproc", str(input_params["num_processes"]), "--master_port", str(_free_port())]
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        per_node = len(visible.split(",")) if visible else 1
        command += [
            "--no_ssh",
            "--num_nodes",
            str(input_params["num_processes"] // per_node),
            "--node_rank",
            os.environ["RANK"],
            "--nproc",
            str(per_node),
            "--master_addr",
            os.environ["MASTER_ADDR"],
            "--master_port",
            os.environ["MASTER_PORT"],
            "--rdzv_id",
            os.environ.get("PYSPARK_TORCH_DISTRIBUTOR_RDZV_ID", "zerotrain-spark"),
        ]
    deepspeed = ["--deepspeed"] + (["--deepspeed_config", config_path] if config_path else [])
    return [*command, train_path, *map(str, args), *deepspeed]


def _run_script(input_params: dict[str, Any], train_path: str, *args: Any, **kwargs: Any) -> None:
    if kwargs:
        raise ValueError("DeepspeedTorchDistributor: a script takes no keyword arguments")
    with _config_path(input_params["deepspeed_config"]) as config_path:
        command = launch_command(input_params, train_path, list(args), config_path)
        TorchDistributor._execute_command(command, log_streaming_client=input_params.get("log_streaming_client"))


def _run_function(input_params: dict[str, Any], train_fn: Callable, run_pytorch_file_fn, *args: Any, **kwargs: Any):
    from pyspark import cloudpickle

    work = tempfile.mkdtemp(prefix="zerotrain_spark_fn_")
    try:
        payload, output = os.path.join(work, "fn.pickle"), os.path.join(work, "output.pickle")
        with open(payload, "wb") as f:
            cloudpickle.dump((train_fn, args, kwargs), f)
        run_pytorch_file_fn(input_params, _RUNNER, payload, output)
        if not os.path.exists(output):
            return None  # this node does not host global rank 0
        with open(output, "rb") as f:
            return cloudpickle.load(f)  # written by rank 0 of this run, in our private directory
    finally:
        shutil.rmtree(work, ignore_errors=True)
