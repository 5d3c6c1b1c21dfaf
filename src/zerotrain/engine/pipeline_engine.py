"""``PipelineEngine``: DeepSpeed's pipeline engine (``train_batch``/``eval_batch``) on torch's
``torch.distributed.pipelining`` schedules, with ZeRO stages 0-2 over each stage's data replicas.

It lives in the engine package (the engine knows pipelines, the pipeline package knows no engine:
tests/test_layout.py keeps the package graph acyclic); ``zerotrain.runtime.pipe.engine`` is
DeepSpeed's path to it.

One ``train_batch()`` is one optimizer step over ``gradient_accumulation_steps`` micro-batches:

1. the first and last stage pull the micro-batches (``next(data_iter)`` that many times; with
   V-shaped virtual stages both are on pipe rank 0, which pulls each batch once);
2. torch's schedule (``zerotrain.pipeline.schedule``) runs them; the last stage scales each loss
   once (1/M, times the fp16 loss scale). Gradients accumulate locally: the stage object's
   backward is open with reduction deferred (``no_sync``) for the whole schedule;
3. tied gradients are summed over their tied groups (``allreduce_tied_weight_gradients``);
4. one boundary pass reduces every gradient bucket over the data group (ZeRO 0/1: all-reduce or
   reduce-scatter, ZeRO 2: reduce-scatter into the shards);
5. the step core's model step (engine/step_core.py, the one ``ZeroTrainEngine.step`` runs): the
   gradient norm and the overflow decision over every stage (the stage object's ``norm_group``),
   clipping, the optimizer, the LR scheduler, counters and monitors;
6. the mean loss over the micro-batches, averaged over the data group, broadcast to every stage.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import torch

from zerotrain.checkpoint.pipeline import PipelineFileNames
from zerotrain.comm import collectives
from zerotrain.engine.data import RepeatingLoader
from zerotrain.engine.engine import ZeroTrainEngine, _cast_floats
from zerotrain.engine.step_core import TrainingState
from zerotrain.log import log_rank0
from zerotrain.pipeline import timeline as _timeline
from zerotrain.pipeline.schedule import StageRunner
from zerotrain.pipeline.specs import PipelineError, TiedLayerSpec

if TYPE_CHECKING:
    from zerotrain.pipeline.module import PipelineModule

_ONLY_TRAIN_BATCH = "Only train_batch() is accessible in pipeline mode."


def _pipeline_error(message: str) -> Exception:
    return PipelineError(message)


def check_pipeline_config(config) -> None:
    """What the pipeline engine refuses, before anything is built (one line each)."""
    zero = config.zero_optimization
    if zero.stage >= 3:
        raise NotImplementedError(
            f"zero_optimization.stage={zero.stage} with a PipelineModule: ZeRO-3 is not "
            "supported with pipeline parallelism yet; use stage 0, 1 or 2"
        )
    if zero.stage > 0 and not zero.ignore_unused_parameters:
        raise NotImplementedError(
            "zero_optimization.ignore_unused_parameters=false with a PipelineModule is "
            "not supported (the pipeline reduces once per batch); set it to true"
        )
    if config.flops_profiler.enabled:
        raise NotImplementedError(
            "flops_profiler.enabled=true with a PipelineModule is not supported (the "
            "profiler hooks engine.forward, which train_batch does not call); profile "
            "the stages' layers with zerotrain.profiling.flops_profiler.get_model_profile"
        )
    if config.progressive_layer_drop.enabled:
        raise ValueError(
            "progressive_layer_drop is not supported with a PipelineModule (the pipeline "
            "engine calls the stages itself, with no pld_theta); set "
            "progressive_layer_drop.enabled to false"
        )
    if config.torch_autocast.enabled:
        raise NotImplementedError(
            "torch_autocast.enabled with a PipelineModule is not supported yet (stage "
            "forwards are not autocast); use bf16 or fp16, or a non-pipeline model"
        )


class PipelineEngine(ZeroTrainEngine):
    """The engine ``zerotrain.initialize`` returns for a ``PipelineModule``: train with
    ``train_batch()``, evaluate with ``eval_batch()``; ``forward``/``backward``/``step`` raise.

    A subclass of ``ZeroTrainEngine`` (``deepspeed.DeepSpeedEngine``), as DeepSpeed's
    ``PipelineEngine`` is of ``DeepSpeedEngine``: ``isinstance(engine, DeepSpeedEngine)`` holds and
    every engine method DeepSpeed's pipeline engine answers is here. The training loop is not
    inherited: ``train_batch`` drives the same step core (``self._core``) ``engine.step()`` does."""

    module: PipelineModule  # initialize builds this engine for a PipelineModule only

    def __init__(
        self, module, config, optimizer=None, lr_scheduler=None, training_dataloader=None, topology=None
    ) -> None:
        check_pipeline_config(config)
        super().__init__(
            module, config, optimizer=optimizer, lr_scheduler=lr_scheduler, training_dataloader=None, topology=topology
        )
        self.grid = module.mpu()
        self.stage_id = self.topology.rank("pipe")
        self.num_stages = self.topology.size("pipe")
        self.micro_batches = self._core.accumulation_steps
        self.micro_batch_size = self._core.settings.micro_batch_size
        pipe = config.pipeline
        virtual = _virtual_stages(module, pipe)
        _apply_checkpoint_settings(module, pipe)
        cast = None
        if self.precision.auto_cast:
            cast = functools.partial(_cast_floats, dtype=self.precision.param_dtype)
        self._runner = StageRunner(
            module,
            self.stage_id,
            self.num_stages,
            self.device,
            self.topology.group("pipe"),
            schedule=pipe.schedule,
            cast_inputs=cast,
            first_rank=self.grid.stage_to_global(0),
            dynamic_shape=bool(getattr(module, "dynamic_shape", False)),
            virtual_stages=virtual,
            virtual_layout=getattr(module, "virtual_layout", "looped"),
        )
        # The pipe rank computing the loss: the last one, or rank 0 when the stages form a V.
        self._loss_rank = (
            self.num_stages - 1 if virtual == 1 else module.rank_of_virtual_stage(self.num_stages * virtual - 1)
        )
        self._runner._schedule(self.micro_batches)  # torch's limits on M, one line on every rank now
        self._runner.on_weight_grads = self._fold_assigned_grads
        self.data_iterator = None
        self.batch_fn = None
        self.total_loss: torch.Tensor | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self.dp_group_loss: torch.Tensor | None = None
        # Where each stage waits ("pipeline": {"timeline": true}): per-stage events of the last batch.
        self._clock: _timeline.StageClock | None = None
        self._last_timeline: list = []
        self._last_bubble: dict | None = None
        if pipe.timeline:
            sync = self.accelerator.synchronize if self.device.type != "cpu" else None
            self._clock = _timeline.StageClock(self.stage_id, sync)
            self._runner.clock = self._clock  # the last stage's loss counts as its forward
        self._print_window = [0.0, 0]  # DeepSpeed's "iter time": seconds and batches since the last print
        if training_dataloader is not None:
            self.training_dataloader = training_dataloader
            self.set_dataiterator(iter(RepeatingLoader(training_dataloader)))

    # -- who is who ----------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        """This rank runs the pipeline's first (virtual) stage: it reads the inputs."""
        return self._runner.is_first

    def is_last_stage(self) -> bool:
        """This rank runs the pipeline's last (virtual) stage: it reads the labels and computes
        the loss (pipe rank P - 1; rank 0 with V-shaped virtual stages, also the first)."""
        return self._runner.is_last

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def reset_activation_shape(self) -> None:
        """Infer the shapes of what crosses stages again at the next batch (call it on every
        stage, e.g. before evaluating with another micro-batch size); with
        ``PipelineModule(dynamic_shape=True)`` that happens whenever the input shapes change."""
        self._runner.reset_activation_shape()

    def _reads_data(self) -> bool:
        return self.is_first_stage() or self.is_last_stage()

    # -- data ----------------------------------------------------------------------------
    def set_dataiterator(self, iterator) -> None:
        """The iterator ``train_batch()`` pulls from (kept on the first and last stage only)."""
        if self._reads_data():
            self.data_iterator = iterator

    def set_dataloader(self, loader) -> None:
        if self._reads_data():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_batch_fn(self, fn) -> None:
        """Post-process every batch pulled (``fn(batch) -> (inputs, labels)``)."""
        self.batch_fn = fn

    def _pull(self, n: int, iterator) -> tuple[list, list]:
        if not self._reads_data():
            return [], []
        if iterator is None:
            raise ValueError(
                "train_batch()/eval_batch(): no data on the first/last pipeline stage; pass "
                "data_iter=, call set_dataiterator(), or give initialize(training_data=...)"
            )
        inputs, labels = [], []
        for _ in range(n):
            batch = next(iterator)
            if self.batch_fn is not None:
                batch = self.batch_fn(batch)
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise ValueError(
                    "a pipeline batch must be (inputs, labels): the first stage reads inputs, "
                    f"the last labels; got {type(batch).__name__}"
                )
            inputs.append(self._to_device(batch[0]) if self.is_first_stage() else None)
            labels.append(self._to_device(batch[1]) if self.is_last_stage() else None)
        return inputs, labels

    def _to_device(self, tree):
        from torch.utils._pytree import tree_map

        return tree_map(lambda t: t.to(self.device) if torch.is_tensor(t) else t, tree)

    # -- training ------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the
        mean loss (averaged over the data-parallel replicas) on every stage."""
        if not torch.is_grad_enabled():
            raise _pipeline_error("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        started = time.perf_counter()
        core = self._core
        self.module.train()
        m = self.micro_batches
        inputs, labels = self._pull(m, self.data_iterator)
        factor = self.loss_scaler.loss_scale / m  # each micro-batch's loss, scaled once
        with core.phase(TrainingState.BACKWARD):  # the schedule runs forwards and backwards
            self._zero.begin_backward(False, True)  # accumulate locally for the whole schedule
            try:
                self._begin_timeline()
                losses, _ = self._runner.run(inputs, labels, m, train=True, factor=factor)
                self._finish_timeline()
            except BaseException:
                if self._clock is not None:
                    self._clock.active = False
                self._zero.abort_backward()
                raise
            self._zero.end_backward()
            if self._runner.assigns_grads:  # zero-bubble weight steps wrote .grad past the hooks
                self._fold_assigned_grads(self.module.parameters())
            # Summed where the stage accumulates them (not .grad with fp32 accumulation of 16-bit weights).
            self.module.allreduce_tied_weight_gradients(self._zero.accumulated_grad)
            self._reduce_gradients()
        core.count_micro_steps(m)
        core.model_step(None)
        loss = self._aggregate_loss(losses)
        self.total_loss = self.agg_train_loss = loss
        core.record_loss(loss)
        core.log_step()
        self._log_pipeline_step(time.perf_counter() - started)
        return loss

    # -- the timeline: where each stage waits -------------------------------------------------
    def _begin_timeline(self) -> None:
        """Every stage starts its clock at one moment: right after a barrier over the pipe group."""
        if self._clock is None:
            return
        self._clock.attach(self._runner)  # torch's stages are rebuilt when the shapes change
        if self.num_stages > 1:
            collectives.barrier(group=self.topology.group("pipe"))
        self._clock.begin()

    def _finish_timeline(self) -> None:
        """Closing barrier, then every stage's events on every stage of the pipe group."""
        if self._clock is None:
            return
        if self.num_stages > 1:
            collectives.barrier(group=self.topology.group("pipe"))
        span = self._clock.finish()
        events, spans = _timeline.gather_timeline(
            self._clock.events, span, self.stage_id, self.num_stages, self.topology.group("pipe"), self.device
        )
        self._last_timeline = events
        self._last_bubble = _timeline.summarize(
            events,
            self.num_stages,
            self.micro_batches,
            max(spans),
            self._runner.schedule_name,
            self._runner.virtual_stages,
        )

    def pipeline_timeline(self) -> list:
        """The last ``train_batch``'s events of every stage of this replica's pipeline, on every
        stage: ``PipelineEvent(stage, kind, start, end)`` tuples (kind ``"forward"``, ``"backward"``,
        ``"weight"`` or ``"comm"``, seconds from the batch's start). Needs ``"pipeline": {"timeline": true}``."""
        self._need_timeline("pipeline_timeline()")
        return list(self._last_timeline)

    def pipeline_bubble(self) -> dict | None:
        """The last batch's busy/comm/idle seconds and shares per stage beside the schedule's ideal
        bubble (``zerotrain.pipeline.timeline.summarize``); None before the first batch."""
        self._need_timeline("pipeline_bubble()")
        return self._last_bubble

    def save_pipeline_timeline(self, path) -> None:
        """Write the last batch's timeline as JSON for ``python -m zerotrain.pipeline.timeline``
        (call it on one rank, e.g. the first stage)."""
        self._need_timeline("save_pipeline_timeline()")
        if self._last_bubble is None:
            raise ValueError("save_pipeline_timeline(): no batch timed yet; call train_batch() first")
        _timeline.save_timeline(
            path,
            self._last_timeline,
            self.num_stages,
            self.micro_batches,
            self._last_bubble["duration"],
            schedule=self._runner.schedule_name,
            virtual_stages=self._runner.virtual_stages,
        )

    def _need_timeline(self, what: str) -> None:
        if self._clock is None:
            raise ValueError(
                f'{what}: the pipeline timeline is off; set "pipeline": {{"timeline": true}} in the config'
            )

    def _log_pipeline_step(self, elapsed: float) -> None:
        """DeepSpeed's pipeline line every ``steps_per_print`` (global rank 0) and, with the
        timeline on, zerotrain's busy/idle line; the monitors get the bubble every step."""
        if self._last_bubble is not None and self.is_first_stage() and self.monitor.monitors:
            self.monitor.write_events(_timeline.monitor_events(self._last_bubble, self.global_samples))
        window = self._print_window
        window[0] += elapsed
        window[1] += 1
        every = self._core.settings.steps_per_print
        if not every or self.global_steps % every:
            return
        iter_time = window[0] / max(window[1], 1)
        self._print_window = [0.0, 0]
        tput = self.train_batch_size() / max(iter_time, 1e-12)
        loss = self.agg_train_loss
        assert loss is not None  # train_batch sets it before it logs
        log_rank0(
            f"steps: {self.global_steps} loss: {float(loss):0.4f} "
            f"iter time (s): {iter_time:0.3f} samples/sec: {tput:0.3f}"
        )
        if self._last_bubble is not None:
            log_rank0(_timeline.describe(self._last_bubble))

    def _fold_assigned_grads(self, params) -> None:
        """Bring the ``.grad`` a schedule's weight step assigned by hand into the stage's gradient
        buffers, as the gradient hooks would (``accumulated_grad`` adopts a replaced ``.grad``:
        into the fp32 buffer of 16-bit weights after every micro-batch's weight step)."""
        for param in params:
            self._zero.accumulated_grad(param)

    def _reduce_gradients(self) -> None:
        """The batch's one reduction over the data group: a boundary pass that computes no
        gradient launches every bucket's collective and waits for it."""
        self._zero.begin_backward(True, False)
        self._zero.end_backward()

    def _aggregate_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean over micro-batches on the last stage, averaged over the data group there
        (``dp_group_loss`` before the average), then broadcast over the pipe group."""
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage() and losses:
            loss = torch.stack([part.float() for part in losses]).mean()
            self.dp_group_loss = loss.clone()
            if self.dp_world_size > 1:
                collectives.all_reduce(loss, group=self.data_parallel_group)
                loss /= self.dp_world_size
        if self.num_stages > 1:
            src = self.grid.stage_to_global(self._loss_rank)
            collectives.broadcast(loss, src=src, group=self.topology.group("pipe"))
        return loss

    # -- evaluation ----------------------------------------------------------------------
    def eval_batch(
        self,
        data_iter,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ):
        """Forward only over ``num_micro_batches`` (default: gradient_accumulation_steps)
        micro-batches pulled from ``data_iter``. Returns the loss averaged over micro-batches and
        the data group (``reduce_output="avg"``; None: the per-micro-batch list, last stage),
        broadcast to every stage with ``bcast_loss``; ``return_logits=True`` returns
        ``(loss, outputs)`` with the last micro-batch's outputs on the last stage (None elsewhere)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        n = num_micro_batches or self.micro_batches
        was_training = self.module.training
        self.module.eval()
        try:
            inputs, labels = self._pull(n, data_iter if self._reads_data() else None)
            with torch.no_grad(), self._core.phase(TrainingState.FORWARD):
                losses, outputs = self._runner.run(inputs, labels, n, train=False, compute_loss=compute_loss)
        finally:
            self.module.train(was_training)
        values = losses if compute_loss else outputs
        result: torch.Tensor | list | None = None  # the mean, or the per-micro-batch values
        if self.is_last_stage():
            result = values
            if reduce_output == "avg" and values and all(torch.is_tensor(v) for v in values):
                result = torch.stack([v.float() for v in values]).mean(0)
                if self.dp_world_size > 1:
                    collectives.all_reduce(result, group=self.data_parallel_group)
                    result /= self.dp_world_size
        if compute_loss and bcast_loss and reduce_output == "avg" and self.num_stages > 1:
            result = result if result is not None else torch.zeros((), device=self.device)
            assert isinstance(result, torch.Tensor)  # the mean: the last stage's losses are tensors
            src = self.grid.stage_to_global(self._loss_rank)
            collectives.broadcast(result, src=src, group=self.topology.group("pipe"))
        if return_logits:
            return result, (outputs[-1] if outputs else None)
        return result

    # -- checkpoints ---------------------------------------------------------------------
    # save_checkpoint/load_checkpoint are the engine's (engine/checkpoints.py), which writes a
    # pipeline engine's checkpoint in DeepSpeed's layout (zerotrain/checkpoint/pipeline.py): every
    # rank of every stage calls them; a checkpoint loads with any number of stages or replicas.
    def checkpoint_layout(self) -> PipelineFileNames:
        """This stage's files in DeepSpeed's pipeline layout (``zerotrain.checkpoint.pipeline``)."""
        return PipelineFileNames(
            self.stage_id,
            self.num_stages,
            self.precision.param_dtype == torch.bfloat16,
            elsewhere=self.checkpoint_name_elsewhere,
        )

    def checkpoint_name_elsewhere(self, name: str) -> bool:
        """Whether a saved parameter or buffer ``name`` belongs to a layer another stage holds
        (``load_checkpoint`` expects it there rather than calling it unexpected)."""
        module = self.module
        head, _, rest = name.partition(".")
        if head.isdigit():
            idx = int(head)
            return 0 <= idx < module._num_layers and not module.owns_layer(idx)
        if head == "tied_modules":
            key = rest.partition(".")[0]
            return key not in module.tied_modules and any(
                isinstance(spec, TiedLayerSpec) and spec.key == key for spec in module._layer_specs
            )
        return False

    def destroy(self) -> None:
        """The engine's ``destroy()``, and the timeline's wrapper of torch's p2p wait removed
        (with the last clock that installed it)."""
        if self._clock is not None:
            self._clock.close()
        super().destroy()

    # -- disabled ------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise _pipeline_error(_ONLY_TRAIN_BATCH)

    def backward(self, *args, **kwargs):
        raise _pipeline_error(_ONLY_TRAIN_BATCH)

    def step(self, *args, **kwargs):
        raise _pipeline_error(_ONLY_TRAIN_BATCH)


def _virtual_stages(module, pipe) -> int:
    """The module's chunks per rank; ``pipeline.virtual_stages``, when set, must agree."""
    built = getattr(module, "virtual_stages", 1)
    if pipe.virtual_stages != "auto" and pipe.virtual_stages != built:
        raise ValueError(
            f"pipeline.virtual_stages={pipe.virtual_stages} but the PipelineModule was built with "
            f"virtual_stages={built}: build it with PipelineModule(..., virtual_stages="
            f'{pipe.virtual_stages}) or set pipeline.virtual_stages to "auto"'
        )
    return built


def _apply_checkpoint_settings(module, pipe) -> None:
    """DeepSpeed's engine overrides the module's activation checkpoint interval (when > 0) and,
    with ``use_reentrant: false``, its checkpoint function."""
    if pipe.activation_checkpoint_interval > 0:
        module.activation_checkpoint_interval = pipe.activation_checkpoint_interval
    if not pipe.use_reentrant and hasattr(module, "activation_checkpoint_func"):
        from torch.utils.checkpoint import checkpoint

        module.activation_checkpoint_func = functools.partial(checkpoint, use_reentrant=False)
