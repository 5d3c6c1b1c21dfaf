"""The adapter between the pipeline engine and ``torch.distributed.pipelining``.

torch owns the schedule, the point-to-point transfers and the per-stage backward; this module only
hands it what DeepSpeed's API gives the engine: a list of micro-batches pulled on the first and
last stage, the module's ``loss_fn`` and the gradient scale.

- The stage's module is wrapped (``_StageModule``) so torch calls it with one tensor per input:
  on the first stage that tensor is the micro-batch's index and the wrapper looks the micro-batch
  up (any structure, any size per micro-batch, no copy into one batch); later stages get the
  activations torch received.
- The last stage's target is the micro-batch index too: ``_LossFunction`` looks the labels up,
  computes ``loss_fn(outputs, labels)`` (the outputs themselves with ``loss_fn=None``), records
  the unscaled loss and returns it scaled once, there: divided by the number of micro-batches and
  multiplied by the fp16 loss scale (DeepSpeed's fix #8154). Schedules are built with
  ``scale_grads=False`` so torch scales nothing again.
- One schedule per (kind, number of micro-batches), built on first use and reused; torch infers
  the shapes of what crosses stages at its first step, once.
- Virtual stages (``PipelineModule(virtual_stages=V)``, V >= 2): one ``PipelineStage`` per local
  chunk ``c`` (virtual stage ``c * P + rank`` of ``P * V``, torch's looped layout), all handed to
  torch's multi-stage schedule (``"interleaved_1f1b"``: ``ScheduleInterleaved1F1B``,
  ``"looped_bfs"``: ``ScheduleLoopedBFS``, ``"zero_bubble"``: ``ScheduleInterleavedZeroBubble``).
  The first two run full backwards, so the gradient hooks fire as with one stage; zero-bubble's
  weight steps assign ``.grad`` by hand, past the hooks (``assigns_grads``): the engine folds
  every ``.grad`` into its gradient buffers before the batch's one reduction.
- V-shaped schedules (``PipelineModule(virtual_stages=2, virtual_layout="v")``): rank ``r`` runs
  virtual stages ``r`` and ``2P - 1 - r`` (``partition.rank_virtual_stages``), so rank 0 holds
  both the first and the last stage (it reads the inputs and the labels and computes the loss).
  ``"zbv"``: ``ScheduleZBVZeroBubble``, ``"dualpipev"``: ``ScheduleDualPipeV``; both split some
  backwards into input- and weight-gradient steps, folded in as for zero-bubble.
- Shapes (``ShapeAgreement``): before every batch the first stage broadcasts, over the pipe
  group, a key of its micro-batches' input shapes and dtypes. When it changes, every stage
  rebuilds its ``PipelineStage`` and schedules (torch infers again) if the module has
  ``dynamic_shape=True`` or ``reset_activation_shape()`` was called; otherwise every stage raises
  the same one-line error naming them. Micro-batches of one batch must share their shapes (torch
  receives one shape per batch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zerotrain.pipeline.partition import rank_virtual_stages

if TYPE_CHECKING:
    from zerotrain.pipeline.timeline import StageClock

# The schedules offered (tested against single-process training; docs/pipeline.md).
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev")  # V >= 2 chunks
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per rank in a V (PipelineModule(virtual_layout="v"))
# weight gradients assigned to .grad outside autograd's hooks
WEIGHT_STEP_SCHEDULES = ("zero_bubble", "zbv", "dualpipev")
DEFAULT_SCHEDULE = "1f1b"  # DeepSpeed's TrainSchedule is synchronous 1F1B


def _schedule_class(name: str):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
    )
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    return {
        "1f1b": Schedule1F1B,
        "gpipe": ScheduleGPipe,
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "looped_bfs": ScheduleLoopedBFS,
        "zero_bubble": ScheduleInterleavedZeroBubble,
        "zbv": ScheduleZBVZeroBubble,
        "dualpipev": ScheduleDualPipeV,
    }[name]


def check_schedule(schedule: str, virtual_stages: int, layout: str = "looped") -> None:
    """One line when the schedule and the module's chunks per rank (and their layout) do not go
    together."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline.schedule={schedule!r} is not offered; use one of {list(SCHEDULES)}")
    if schedule in V_SCHEDULES and (virtual_stages != 2 or layout != "v"):
        raise ValueError(
            f"pipeline.schedule={schedule!r} runs 2 model chunks per rank placed in a V (rank r "
            "holds virtual stages r and 2P-1-r): build the PipelineModule with virtual_stages=2, "
            f'virtual_layout="v" (it has virtual_stages={virtual_stages}, '
            f"virtual_layout={layout!r})"
        )
    if layout == "v" and schedule not in V_SCHEDULES:
        raise ValueError(
            f"pipeline.schedule={schedule!r} needs the looped placement of virtual stages but the "
            'PipelineModule was built with virtual_layout="v": use "zbv" or "dualpipev", '
            'or build it with virtual_layout="looped"'
        )
    if schedule in MULTI_STAGE_SCHEDULES and virtual_stages < 2:
        raise ValueError(
            f"pipeline.schedule={schedule!r} runs several model chunks per rank: build the "
            "PipelineModule with virtual_stages=2 or more (and set pipeline.virtual_stages), "
            'or use "1f1b"/"gpipe"'
        )
    if schedule not in MULTI_STAGE_SCHEDULES and virtual_stages > 1:
        raise ValueError(
            f"pipeline.schedule={schedule!r} runs one stage per rank but the PipelineModule has "
            f'virtual_stages={virtual_stages}: use "interleaved_1f1b", "looped_bfs" or '
            '"zero_bubble", or '
            "build the PipelineModule with virtual_stages=1"
        )


def check_torch_supports_pipelining() -> None:
    """torch.distributed.pipelining with working gloo point-to-point needs torch >= 2.8."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 8):
        raise RuntimeError(
            f"pipeline parallelism needs torch >= 2.8 (torch.distributed.pipelining on "
            f"gloo); this is torch {torch.__version__}: upgrade torch"
        )


class _StageModule(nn.Module):
    """What torch's ``PipelineStage`` runs: the stage's layers, called DeepSpeed's way."""

    def __init__(self, module: nn.Module, runner: StageRunner, first: bool):
        super().__init__()
        self.module = module
        self._runner = runner  # not an nn.Module: a plain attribute
        self._first = first  # the pipeline's first (virtual) stage: looks its micro-batch up

    def forward(self, *args):
        if self._first:
            inputs = self._runner.micro_input(args[0])
        else:
            inputs = args[0] if len(args) == 1 else tuple(args)
        outputs = self.module(inputs)
        if self._runner.assigns_grads and torch.is_grad_enabled():
            outputs = _no_views(outputs)
        return outputs


class StageRunner:
    """Runs one pipeline stage's share of a batch through a torch schedule.

    ``module``: the ``PipelineModule`` (this stage's layers); ``stage_id``/``num_stages``;
    ``group``: the pipe group (its rank i is stage i); ``cast_inputs``: applied to the first
    stage's micro-batch inputs (the engine's auto-cast); ``virtual_stages``: the module's chunks
    on this rank, placed by ``virtual_layout`` (``module.chunk(c)`` is virtual stage
    ``rank_virtual_stages(stage_id, ...)[c]``). ``is_first``/``is_last``: this rank holds the
    pipeline's first/last (virtual) stage (both on rank 0 in a V)."""

    clock: StageClock | None  # set by a pipeline engine with a timeline; read with getattr (unset: none)

    def __init__(
        self,
        module: nn.Module,
        stage_id: int,
        num_stages: int,
        device: torch.device,
        group,
        schedule: str = DEFAULT_SCHEDULE,
        cast_inputs: Callable[[Any], Any] | None = None,
        first_rank: int = 0,
        dynamic_shape: bool = False,
        virtual_stages: int = 1,
        virtual_layout: str = "looped",
    ):
        check_torch_supports_pipelining()
        check_schedule(schedule, virtual_stages, virtual_layout)
        self.virtual_stages = virtual_stages
        # This rank's virtual stage per chunk, of num_stages * virtual_stages.
        self.stage_indices = rank_virtual_stages(stage_id, num_stages, virtual_stages, virtual_layout)
        # The schedule's weight steps write .grad by hand, past the gradient hooks: after each one
        # ``on_weight_grads(params)`` (set by the engine) folds the chunk's .grad in, as the hooks
        # would have, and the engine folds every .grad again after run().
        self.assigns_grads = schedule in WEIGHT_STEP_SCHEDULES
        self.on_weight_grads: Callable[[Any], None] | None = None
        self.module = module
        self.stage_id, self.num_stages = stage_id, num_stages
        total = num_stages * virtual_stages
        self.is_first, self.is_last = 0 in self.stage_indices, total - 1 in self.stage_indices
        self.device = device
        self.schedule_name = schedule
        self._cast = cast_inputs
        if virtual_stages == 1:
            self._wrappers = [_StageModule(module, self, first=self.is_first)]
        else:
            self._wrappers = [
                _StageModule(module.chunk(c), self, first=index == 0) for c, index in enumerate(self.stage_indices)
            ]
        self._group = group
        self._schedules: dict[int, Any] = {}
        self._build_stage()
        self.shapes = ShapeAgreement(self.is_first, num_stages, group, first_rank, device, dynamic_shape)
        self._inputs: Sequence[Any] = ()
        self._labels: Sequence[Any] = ()
        self._losses: dict[int, torch.Tensor] = {}
        self._factor = 1.0
        self._compute_loss = True

    def _build_stage(self) -> None:
        """A new ``PipelineStage`` per local chunk (torch infers what crosses stages at its first
        step) and no schedule yet. ``stage``: the chunk holding the pipeline's last stage where
        this rank has it (its outputs are there), else the last chunk's."""
        from torch.distributed.pipelining import PipelineStage

        total = self.num_stages * self.virtual_stages
        self.stages = [
            PipelineStage(wrapper, index, total, self.device, group=self._group)
            for index, wrapper in zip(self.stage_indices, self._wrappers)
        ]
        self.stage = next((s for s in self.stages if s.stage_index == total - 1), self.stages[-1])
        if self.schedule_name in V_SCHEDULES:
            for stage in self.stages:
                _skip_local_grad_handoff_in_eval(stage)
        if self.assigns_grads:
            for stage, wrapper in zip(self.stages, self._wrappers):
                stage.backward_weight_one_chunk = self._after_weight_step(stage.backward_weight_one_chunk, wrapper)
        self._schedules = {}

    def _after_weight_step(self, weight_step, wrapper: nn.Module):
        def run(*args, **kwargs):
            result = weight_step(*args, **kwargs)
            if self.on_weight_grads is not None:
                self.on_weight_grads(wrapper.parameters())
            return result

        return run

    def reset_activation_shape(self) -> None:
        """Infer the shapes of what crosses stages again at the next batch (DeepSpeed's name;
        every stage must call it)."""
        self.shapes.reset()

    # -- what the wrapper and the loss look up --------------------------------------------
    def micro_input(self, index: torch.Tensor):
        inputs = self._inputs[int(index.reshape(-1)[0])]
        return self._cast(inputs) if self._cast is not None else inputs

    def _loss(self, output, target: torch.Tensor) -> torch.Tensor:
        i = int(target.reshape(-1)[0])
        if not self._compute_loss:
            return output.sum() * 0 if torch.is_tensor(output) else torch.zeros((), device=self.device)
        loss_fn = getattr(self.module, "loss_fn", None)
        loss = loss_fn(output, self._labels[i]) if loss_fn is not None else output
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(
                "the pipeline's loss must be a scalar tensor: loss_fn(outputs, labels) "
                "(or, with loss_fn=None, the last stage's output) returned "
                f"{type(loss).__name__}{'' if not torch.is_tensor(loss) else tuple(loss.shape)}"
            )
        # Metadata inference calls this once before the micro-batches: by index, the real call wins.
        self._losses[i] = loss.detach()
        clock = getattr(self, "clock", None)  # the engine's timeline (StageClock): the loss is forward work
        if clock is not None:
            clock.extend_last("forward")
        if self._factor != 1.0:
            return loss.float() * self._factor
        return _no_views(loss) if self.assigns_grads else loss

    def _schedule(self, n: int):
        if n not in self._schedules:
            cls = _schedule_class(self.schedule_name)
            multi = self.schedule_name in MULTI_STAGE_SCHEDULES
            try:
                self._schedules[n] = cls(self.stages if multi else self.stage, n, loss_fn=self._loss, scale_grads=False)
            except ValueError as error:
                if self.schedule_name == "dualpipev":  # at least one micro-batch per virtual stage
                    total = self.num_stages * self.virtual_stages
                    raise ValueError(
                        f"pipeline schedule 'dualpipev' with {n} micro-batches on {self.num_stages} "
                        f"ranks x 2 virtual stages: {error} Set gradient_accumulation_steps (the "
                        f"number of micro-batches) to {total} or more"
                    ) from None
                if multi:  # interleaved: n a multiple of max(1, n // P)
                    raise ValueError(
                        f"pipeline schedule {self.schedule_name!r} with {n} micro-batches on "
                        f"{self.num_stages} ranks x {self.virtual_stages} virtual stages: "
                        f"{error} Set gradient_accumulation_steps (the number of micro-batches) "
                        f"to a multiple of {self.num_stages} (the pipeline ranks)"
                    ) from None
                # 1F1B: fewer micro-batches than stages
                raise ValueError(
                    f"pipeline schedule {self.schedule_name!r} with {n} micro-batches on "
                    f"{self.num_stages} stages: {error} Raise gradient_accumulation_steps "
                    '(the number of micro-batches) or use "pipeline": {"schedule": '
                    '"gpipe"}'
                ) from None
        return self._schedules[n]

    # -- running a batch ------------------------------------------------------------------
    def run(
        self,
        inputs: Sequence[Any],
        labels: Sequence[Any],
        n: int,
        train: bool,
        factor: float = 1.0,
        compute_loss: bool = True,
    ) -> tuple[list[torch.Tensor], list[Any]]:
        """Run ``n`` micro-batches (``inputs`` on the first stage, ``labels`` on the last; other
        stages pass empty lists). ``train``: forward and backward (gradients accumulate into
        ``.grad``), else forward only. Returns the last stage's unscaled losses per micro-batch
        and its outputs per micro-batch (empty lists elsewhere)."""
        if self.shapes.changed(inputs):
            self._build_stage()
        self._inputs, self._labels, self._losses = inputs, labels, {}
        self._factor, self._compute_loss = (factor if train else 1.0), compute_loss
        schedule = self._schedule(n)
        index = torch.arange(n, device=self.device)
        args = (index,) if self.is_first else ()
        target = index if self.is_last else None
        losses: list | None = [] if self.is_last else None
        try:
            if train:
                schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                schedule.eval(*args, target=target, losses=losses)
            outputs = list(self.stage.output_chunks) if self.is_last else []
        finally:
            self._inputs, self._labels = (), ()
            self.stage.output_chunks = []
        recorded = [self._losses[i] for i in range(n)] if self.is_last and compute_loss else []
        self._losses = {}
        return recorded, outputs


def _no_views(tree):
    """Outputs that are views (``nn.Linear`` on 3-d inputs returns one) copied into tensors of
    their own: torch's input-gradient step (``stage_backward_input``) detaches the stage's outputs
    in place, which views refuse; only schedules with weight steps take that path."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.clone() if torch.is_tensor(t) and t._is_view() else t, tree)


def _skip_local_grad_handoff_in_eval(stage) -> None:
    """torch's V schedules run their backward actions in ``eval()`` too, where each is a no-op
    except the hand-off of input gradients between the two adjacent stages on one rank (the V's
    turn, rank P-1), which asserts the stage has a backward. Without a backward there is nothing
    to hand off: skip it, so ``eval_batch`` runs forward only."""
    get_output, set_input = stage.get_local_bwd_output, stage.set_local_bwd_input

    def get_local_bwd_output(mb_index):
        return get_output(mb_index) if stage.has_backward else ()

    def set_local_bwd_input(grads, mb_index):
        if stage.has_backward:
            set_input(grads, mb_index)

    stage.get_local_bwd_output, stage.set_local_bwd_input = get_local_bwd_output, set_local_bwd_input


def _shape_signature(inputs: Any) -> tuple:
    """The shapes and dtypes of one micro-batch's tensors (types of the rest), in tree order."""
    leaves, spec = tree_flatten(inputs)
    return (str(spec),) + tuple(
        (tuple(x.shape), str(x.dtype)) if torch.is_tensor(x) else type(x).__name__ for x in leaves
    )


class ShapeAgreement:
    """Whether this batch's inputs have the shapes the stages were built for, decided by the
    first stage and broadcast over the pipe group (so every stage rebuilds, or raises, together).

    ``dynamic_shape``: rebuild when the shapes change (else raise naming it). One small
    broadcast per batch (none with one stage)."""

    def __init__(
        self, is_first: bool, num_stages: int, group, first_rank: int, device: torch.device, dynamic_shape: bool
    ):
        self.is_first, self.num_stages = is_first, num_stages
        self.group, self.first_rank, self.device = group, first_rank, device
        self.dynamic_shape = dynamic_shape
        self.key: int | None = None  # the shapes the stages were built for (None: none yet)
        self.described = ""  # the first stage's words for them
        self._reset = False
        self.rebuilds = 0  # how many times the stages were rebuilt for new shapes

    def reset(self) -> None:
        self._reset = True

    def changed(self, inputs: Sequence[Any]) -> bool:
        """Collective over the pipe group: True when the stages must be rebuilt for ``inputs``
        (the first stage's micro-batches; other stages pass anything). Raises on every stage
        for micro-batches of different shapes, or changed shapes without ``dynamic_shape``."""
        mixed, key, described = 0, 0, ""
        what = ""  # the first stage names the micro-batch that differs
        if self.is_first and inputs:
            signatures = [_shape_signature(x) for x in inputs]
            mixed = next((i for i, sig in enumerate(signatures) if sig != signatures[0]), 0)
            described = _describe(signatures[0])
            digest = hashlib.blake2b(repr(signatures[0]).encode(), digest_size=7).digest()
            key = int.from_bytes(digest, "little")
            if mixed:
                what = f" (inputs {_describe(signatures[mixed])}, micro-batch 0's {described})"
        if self.num_stages > 1:
            from zerotrain.comm import collectives

            agreed = torch.tensor([key, mixed], dtype=torch.int64, device=self.device)
            collectives.broadcast(agreed, src=self.first_rank, group=self.group)
            key, mixed = int(agreed[0]), int(agreed[1])
        if mixed:
            raise ValueError(
                f"pipeline micro-batch {mixed} has other input shapes than micro-batch 0{what}: "
                "the micro-batches of one train_batch/eval_batch must share their "
                "shapes (torch's pipeline stages receive one shape per batch); pad them to one "
                "length, or vary the shape between batches with PipelineModule(dynamic_shape=True)"
            )
        if self.key is None:
            self.key, self.described, self._reset = key, described, False
            return False
        if key == self.key and not self._reset:
            return False
        if key != self.key and not (self.dynamic_shape or self._reset):
            was = f" (were {self.described}, now {described})" if self.is_first else ""
            raise ValueError(
                f"the pipeline's input shapes changed between batches{was}: the stages infer "
                "the activation shapes once; build the PipelineModule with dynamic_shape=True "
                "to infer them again when they change, or call engine.reset_activation_shape() "
                "on every stage before such a batch"
            )
        self.key, self.described, self._reset = key, described, False
        self.rebuilds += 1
        return True


def _describe(signature: tuple) -> str:
    """``[2, 5, 8] float32`` for each tensor of a ``_shape_signature``."""
    tensors = [f"{list(item[0])} {item[1].replace('torch.', '')}" for item in signature[1:] if isinstance(item, tuple)]
    return ", ".join(tensors) or "no tensors"
