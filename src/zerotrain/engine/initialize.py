"""``zerotrain.initialize``: DeepSpeed's entry point, same signature and return value."""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.accelerator import get_accelerator
from zerotrain.comm import collectives
from zerotrain.comm import logger as comms_logging
from zerotrain.comm.distributed import get_local_rank, init_distributed
from zerotrain.config import ZeroTrainConfig, check_supported, load_config, read_config
from zerotrain.config.auto import resolve_unfilled_auto
from zerotrain.config.load import _pick_source as pick_config_source
from zerotrain.engine.data import DistributedDataLoader
from zerotrain.engine.engine import ZeroTrainEngine
from zerotrain.engine.model_hooks import before_engine
from zerotrain.experts.autoep import apply_autoep, autoep_size
from zerotrain.experts.layer import MoE
from zerotrain.log import log_rank0
from zerotrain.optim import build_lr_scheduler, build_optimizer
from zerotrain.optim.expert_groups import expert_parameters, refuse_unsupported_experts
from zerotrain.optim.placeholders import is_placeholder, resolve_placeholders
from zerotrain.topology import PipelineParallelGrid, Topology, set_current
from zerotrain.zero.flat import split_into_buckets

# Parameters are broadcast from rank 0 in chunks of this many elements, so start-up needs no
# second full copy of the model.
_BROADCAST_CHUNK = 2**22


def initialize(
    args=None,
    model: nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int = 29500,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
    data_parallel_group=None,
):
    """Build the training engine.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; the last three are
    None when not configured. ``config`` is a dict, a JSON path, or None to read
    ``args.deepspeed_config``/``args.zerotrain_config``. ``optimizer`` and ``lr_scheduler`` may be
    objects or callables (``optimizer(params)``, ``lr_scheduler(optimizer)``); a client optimizer
    takes precedence over the config's ``optimizer`` section.

    ``data_parallel_group`` (a ``torch.distributed`` group; default the world) is the group the
    engine shards over and averages across: batch sizes, the dataloader, the rank-0 broadcast
    and every collective use it, so engines on disjoint groups train side by side. ``mpu`` may
    supply it (``mpu.get_data_parallel_group()``) when it describes no model parallelism.
    """
    if model is None:
        raise ValueError("zerotrain.initialize() needs model=<torch.nn.Module>")
    if mesh_param is not None:
        raise NotImplementedError("model parallelism (mesh_param=) is not supported: zerotrain is data-parallel only")
    if config is not None and config_params is not None and config is not config_params:
        raise ValueError("pass the config once: config= and config_params= are aliases")
    config = config if config is not None else config_params
    if is_placeholder(optimizer) or is_placeholder(lr_scheduler):
        # Filled before validation, which rejects "auto"; the filled dict replaces args' config.
        config, optimizer, lr_scheduler, model_parameters = resolve_placeholders(
            read_config(pick_config_source(config, args)), optimizer, lr_scheduler, model_parameters
        )
        args = None

    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    pipeline = _is_pipeline_module(model)
    if pipeline:
        topology = _pipeline_topology(model, mpu, data_parallel_group)
    else:
        topology = build_topology(data_parallel_group, mpu)
    set_current(topology)  # what DeepSpeed's global getters (zerotrain.utils.groups) answer from
    dp_world, dp_rank = topology.data_size, topology.data_rank
    config, args = _resolve_unfilled_auto(config, args, model, topology)
    cfg = load_config(config, args=args, world_size=dp_world)
    check_supported(cfg)
    ep_size = autoep_size(cfg.expert_parallel)  # DeepSpeed's AutoEP section: HF fused experts
    if ep_size is not None:
        model_parameters = apply_autoep(model, ep_size, topology, model_parameters, optimizer)
    experts = _expert_groups(model, cfg, topology, pipeline)
    before_engine(model, cfg)  # the activation_checkpointing section; QLoRA refused at stage 3
    if cfg.comms_logger.enabled or "comms_logger" in cfg.model_fields_set:
        comms_logging.configure(cfg)  # before the broadcast below, so it is logged too

    device = get_accelerator().device(get_local_rank())
    # Also when the caller created the process group itself (init_distributed then returns at
    # once): object collectives and bare ``.cuda()`` calls use the current device (DeepSpeed's
    # engine sets it too).
    get_accelerator().set_device(get_local_rank())
    model.to(device)
    _broadcast_from_rank0(model, topology, experts)

    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    opt = _build_optimizer(optimizer, cfg, params, model)
    sched = _build_scheduler(lr_scheduler, cfg, opt)
    loader = None
    # A pipeline's data is read by its first and last stage only.
    reads_data = not pipeline or topology.rank("pipe") in (0, topology.size("pipe") - 1)
    if training_data is not None and reads_data:
        micro_batch = cfg.train_micro_batch_size_per_gpu
        assert micro_batch is not None  # optional in the schema only until validation resolves it
        loader = DistributedDataLoader(
            training_data,
            batch_size=micro_batch,
            rank=dp_rank,
            world_size=dp_world,
            collate_fn=collate_fn,
            drop_last=cfg.dataloader_drop_last,
            pin_memory=device.type == "cuda",
            shuffle=not pipeline,
        )  # DeepSpeed's pipeline: in order
    engine: ZeroTrainEngine
    if pipeline:
        from zerotrain.engine.pipeline_engine import PipelineEngine

        engine = PipelineEngine(
            model, cfg, optimizer=opt, lr_scheduler=sched, training_dataloader=loader, topology=topology
        )
    else:
        engine = ZeroTrainEngine(
            model, cfg, optimizer=opt, lr_scheduler=sched, training_dataloader=loader, topology=topology
        )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _resolve_unfilled_auto(config, args, model, topology):
    """The config with every "auto" nobody filled resolved for `model` (logged once), and the args
    left to read it from (None once the config is a dict here)."""
    if isinstance(config, ZeroTrainConfig):
        return config, args
    data, lines = resolve_unfilled_auto(read_config(pick_config_source(config, args)), model)
    if not lines:
        return config, args
    log_rank0('config: "auto" values nobody filled: ' + "; ".join(lines), topology=topology)
    return data, None


def _is_pipeline_module(model) -> bool:
    from zerotrain.pipeline import PipelineModule

    return isinstance(model, PipelineModule)


def _pipeline_topology(model, mpu, group) -> Topology:
    """A ``PipelineModule`` brings its own grid (DeepSpeed: ``mpu`` must be None)."""
    if mpu is not None:
        raise ValueError(
            "initialize(mpu=...) with a PipelineModule: the module's own grid (model.mpu()) is used; pass mpu=None"
        )
    topology = model.mpu().topology_
    if group is not None and dist_group_ranks(group) != sorted(topology.axis_ranks("data")):
        raise ValueError(
            "initialize(data_parallel_group=...) with a PipelineModule: the data group comes "
            "from the module's grid; leave data_parallel_group unset"
        )
    return topology


def dist_group_ranks(group) -> list[int]:
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(group))


def build_topology(group, mpu) -> Topology:
    """The engine's topology: ``mpu`` (a ``PipelineParallelGrid``, or a Megatron-style object
    describing data parallelism only), else ``data_parallel_group``, else the world."""
    if mpu is None:
        return Topology.from_group(group)
    if isinstance(mpu, PipelineParallelGrid):
        topology = mpu.topology_
    else:
        for name in (
            "get_model_parallel_world_size",
            "get_tensor_model_parallel_world_size",
            "get_pipeline_model_parallel_world_size",
            "get_sequence_parallel_world_size",
        ):
            size = getattr(mpu, name, None)
            if size is not None and size() > 1:
                raise NotImplementedError(
                    f"initialize(mpu=...): {name}() is {size()}; model, pipeline "
                    "and sequence parallelism from a Megatron mpu are not supported; "
                    "describe the layout with zerotrain.runtime.pipe.topology."
                    "PipelineParallelGrid"
                )
        if not hasattr(mpu, "get_data_parallel_group"):
            raise ValueError("initialize(mpu=...): the mpu has no get_data_parallel_group()")
        topology = None
    mpu_group = mpu.get_data_parallel_group()
    if group is not None and group is not mpu_group:
        raise ValueError(
            "pass the data-parallel group once: data_parallel_group= and mpu.get_data_parallel_group() differ"
        )
    if topology is None:
        return Topology.from_group(mpu_group)
    if topology.size("pipe") > 1:
        raise NotImplementedError(
            f"initialize(mpu=PipelineParallelGrid): {topology.describe()}: a pipe axis "
            "above 1 needs the model to be a zerotrain.pipe.PipelineModule (pass it as "
            "model= with mpu=None); otherwise use num_pp=1"
        )
    # A model axis: each model rank holds its own parameters (the user's split of the model);
    # ZeRO shards and reduces them over the data group, and the gradient norm and the overflow
    # decision sum over the model ranks too (Topology.distinct_group).
    return topology


def _build_optimizer(client, cfg, params, model):
    if client is not None:
        if isinstance(client, torch.optim.Optimizer):
            return client
        if callable(client):
            return client(params)
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer or a callable, got {type(client)!r}")
    if cfg.optimizer is None:
        return None
    return build_optimizer(cfg.optimizer.type, cfg.optimizer.params, params, model.named_parameters())


def _build_scheduler(client, cfg, optimizer):
    if client is not None:
        if callable(client) and not hasattr(client, "step"):
            return client(optimizer)
        return client
    if cfg.scheduler is None:
        return None
    if optimizer is None:
        raise ValueError(
            "config has a 'scheduler' section but no optimizer: add an 'optimizer' "
            "section or pass optimizer= to initialize()"
        )
    return build_lr_scheduler(cfg.scheduler.type, cfg.scheduler.params, optimizer)


def _expert_groups(model: nn.Module, cfg, topology: Topology, pipeline: bool) -> dict[str, int]:
    """``{name: ep_size}`` of the model's expert parameters (DeepSpeed's markers), refused where
    not supported yet; their ``ep_size_N`` groups are built here, on every rank in the same order."""
    experts = expert_parameters(model, topology.data_size)
    refuse_unsupported_experts(experts, model, pipeline)
    for ep_size in sorted(set(experts.values())):
        try:
            topology.expert_groups(ep_size)
        except NotImplementedError as error:
            name = next(n for n, s in experts.items() if s == ep_size)
            raise NotImplementedError(f"parameter {name!r} (group_name='ep_size_{ep_size}'): {error}") from None
    for module in model.modules():  # MoE layers take their groups from the engine's topology
        if isinstance(module, MoE):
            module.set_topology(topology)
    return experts


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module, topology: Topology, experts: dict[str, int] | None = None) -> None:
    """Make every rank of the data group start from its first rank's parameters and buffers;
    expert parameters (``experts``: name -> ep_size) from their expert-data group's first rank
    (the ranks of the data group hold different experts)."""
    if topology.data_size == 1:
        return
    group, src = topology.data_group, topology.first_global_rank("data")
    expert_ids: set[int] = set()
    if experts:
        import torch.distributed as dist

        named = dict(model.named_parameters())
        for ep_size in sorted(set(experts.values())):
            members = [named[n] for n, s in experts.items() if s == ep_size]
            expert_ids.update(id(p) for p in members)
            edp = topology.expert_groups(ep_size).expert_data_group
            _broadcast(members, dist.get_process_group_ranks(edp)[0], edp)
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.numel() and id(t) not in expert_ids]
    _broadcast(tensors, src, group)


def _broadcast(tensors: list, src: int, group) -> None:
    tensors = [t for t in tensors if t.numel()]
    unique = list({t.data_ptr(): t for t in tensors}.values())
    for chunk in split_into_buckets(unique, _BROADCAST_CHUNK):
        if len(chunk) == 1:
            collectives.broadcast(chunk[0].data, src=src, group=group)
            continue
        flat = torch.cat([t.reshape(-1) for t in chunk])
        collectives.broadcast(flat, src=src, group=group)
        offset = 0
        for t in chunk:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
