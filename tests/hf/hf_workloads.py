"""Trainer workloads run on ranks by tests/hf (module level so run_on_ranks can pickle them).

A tiny GPT-2 from config (random init, no dropout so runs are comparable), a fixed in-memory
dataset, and seed 002's ds_config with its "auto" values.
"""

from __future__ import annotations

import torch

TINY_GPT2 = dict(
    vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)
SEQ = 16
MICRO, GAS = 2, 4
STEPS, WORLD = 4, 2


def seed002_config(stage: int, bf16="auto") -> dict:
    """Seed 002's ds_config.json, at `stage` (its bf16 `true` replaced by "auto" for fp32 runs)."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(
            {
                "sub_group_size": 1e9,
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
                "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    return {
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 100,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


def make_model(seed: int = 0, **config):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**TINY_GPT2, **config))


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, samples: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, TINY_GPT2["vocab_size"], (samples, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(
    out_dir: str, *, deepspeed=None, per_device: int = MICRO, steps: int = 4, save_steps: int = 2, **overrides
):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=out_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=GAS,
        max_steps=steps,
        learning_rate=3e-3,
        warmup_steps=1,
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_steps,
        report_to=[],
        seed=0,
        data_seed=0,
        train_sampling_strategy="sequential",
        deepspeed=deepspeed,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def lr_recorder(read):
    """A TrainerCallback that appends ``read()`` (the learning rates the optimizer is about to
    use) before every optimizer step; the list is its ``lrs``."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.lrs = []

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.lrs.append(read())

    return Recorder()


def plain_reference(out_dir: str):
    """transformers.Trainer without zerotrain or DeepSpeed, one process taking the whole global
    batch: its losses, final weights and the per-step learning rates of its optimizer."""
    from transformers import Trainer

    args = training_args(out_dir, per_device=MICRO * WORLD, steps=STEPS, save_strategy="no")
    trainer = Trainer(model=make_model(), args=args, train_dataset=TokenDataset(16 * STEPS))
    recorder = lr_recorder(lambda: [g["lr"] for g in trainer.optimizer.param_groups])
    trainer.add_callback(recorder)
    trainer.train()
    return losses(trainer), {k: v.clone() for k, v in trainer.model.state_dict().items()}, recorder.lrs


def seed002_offload_config(precision: str) -> dict:
    """Seed 002's ZeRO-3 config with the 7B section's optimizer and parameter offload to the CPU,
    every precision value "auto" (`precision` names the one the TrainingArguments turn on)."""
    config = seed002_config(3)
    config["fp16"] = {"enabled": "auto"}
    config["zero_optimization"].update(
        {
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        }
    )
    return config


def zerotrain_trainer_offload_runs(out_dir: str, model_dir: str, untied_dir: str) -> dict:
    """Seed 002's flow at ZeRO-3 with CPU offload, in the order of transformers' run_clm.py:
    TrainingArguments(deepspeed=<config with "auto">) first, then from_config / from_pretrained
    (built partitioned inside zero.Init with "auto" values still unfilled), then the Trainer with
    its own AdamW and schedule (accelerate swaps in DeepSpeedCPUAdam over the AdamW's groups).
    fp32, then fp16 (TrainingArguments(fp16=True)); and transformers' resize_token_embeddings on
    a partitioned model with an untied head (GatheredParameters([w, None, w, None]))."""
    import zerotrain.hf

    zerotrain.hf.use_zerotrain_as_deepspeed()
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    import zerotrain

    data = TokenDataset(16 * STEPS)
    result = {}
    for precision in ("fp32", "fp16"):
        args = training_args(
            f"{out_dir}/{precision}",
            deepspeed=seed002_offload_config(precision),
            steps=STEPS,
            save_strategy="no",
            fp16=precision == "fp16",
        )
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        result[f"{precision}_from_config_local_numel"] = sum(p.numel() for p in built.parameters())
        del built
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        result[f"{precision}_from_pretrained_local_numel"] = sum(p.numel() for p in model.parameters())
        trainer = Trainer(model=model, args=args, train_dataset=data)
        recorder = lr_recorder(lambda: trainer.model_wrapped.get_lr())
        trainer.add_callback(recorder)
        trainer.train()
        engine = trainer.model_wrapped
        result[precision] = {
            "losses": losses(trainer),
            "lrs": recorder.lrs,
            "stage": engine.zero_optimization_stage(),
            "optimizer": type(engine.optimizer).__name__,
            "config": engine.config.raw,
            "param_dtype": str(next(engine.module.parameters()).dtype),
            "weights": {k: v.float().clone() for k, v in engine.module_state_dict().items()},
        }

    # resize_token_embeddings at ZeRO-3 (DeepSpeed-Chat does it after from_pretrained).
    args = training_args(f"{out_dir}/resize", deepspeed=seed002_offload_config("fp32"), steps=STEPS, save_strategy="no")
    model = AutoModelForCausalLM.from_pretrained(untied_dir)
    old_vocab = model.config.vocab_size
    model.resize_token_embeddings(old_vocab + 8)  # as DeepSpeed-Chat: mean_resizing on
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        result["resized"] = {
            k: v.clone() for k, v in model.state_dict().items() if k in ("transformer.wte.weight", "lm_head.weight")
        }
    result["resized_vocab"] = model.config.vocab_size
    # Repeats are skipped too: rank 0's edit through a list naming the weight twice lands once.
    weight = model.lm_head.weight
    with zerotrain.zero.GatheredParameters([weight, None, weight], modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            weight.data.copy_(torch.arange(weight.numel(), dtype=weight.dtype).reshape(weight.shape))
    with zerotrain.zero.GatheredParameters([weight]):
        result["edited"] = weight.detach().clone()
    del args
    return result


def zerotrain_trainer_runs(out_dir: str) -> dict:
    """Every zerotrain Trainer case of tests/hf/test_trainer.py, on each rank of one group."""
    import zerotrain.hf

    zerotrain.hf.use_zerotrain_as_deepspeed()
    from transformers import Trainer

    data = TokenDataset(16 * STEPS)
    result = {}

    # Stage 3, seed 002's flow (gradient checkpointing on), saving every 2 steps.
    args = training_args(
        f"{out_dir}/z3", deepspeed=seed002_config(3), steps=STEPS, save_steps=2, gradient_checkpointing=True
    )
    trainer = Trainer(model=make_model(), args=args, train_dataset=data)
    trainer.train()
    engine = trainer.model_wrapped
    result["z3"] = losses(trainer)
    result["engine_type"] = type(engine).__module__ + "." + type(engine).__name__
    result["filled"] = engine.config.raw
    result["batch"] = (
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
        engine.train_batch_size(),
        engine.zero_optimization_stage(),
    )

    # Resume from step 2 into a differently initialised model: steps 3-4 must repeat exactly.
    args = training_args(f"{out_dir}/resumed", deepspeed=seed002_config(3), steps=STEPS, save_steps=2)
    trainer = Trainer(model=make_model(seed=5), args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=f"{out_dir}/z3/checkpoint-2")
    result["resumed"] = losses(trainer)
    trainer.save_model(f"{out_dir}/final")
    gathered = trainer.model_wrapped.module_state_dict()  # collective at stage 3
    result["gathered"] = {k: v.clone() for k, v in gathered.items()}

    # Stage 2, fp32.
    args = training_args(f"{out_dir}/z2", deepspeed=seed002_config(2), steps=STEPS, save_strategy="no")
    trainer = Trainer(model=make_model(), args=args, train_dataset=data)
    trainer.train()
    result["z2"] = losses(trainer)

    # transformers' own HfDeepSpeedConfig before from_pretrained (under the switch): the model
    # comes back partitioned, and gathered equals what save_pretrained wrote.
    import safetensors.torch
    from transformers import GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig

    import zerotrain

    if trainer.args.process_index == 0:
        make_model(seed=7).save_pretrained(f"{out_dir}/saved")
    torch.distributed.barrier()
    keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3}})
    loaded = GPT2LMHeadModel.from_pretrained(f"{out_dir}/saved")
    result["pretrained_local_numel"] = sum(p.numel() for p in loaded.parameters())
    saved = safetensors.torch.load_file(f"{out_dir}/saved/model.safetensors")
    with zerotrain.zero.GatheredParameters(list(loaded.parameters())):
        state = loaded.state_dict()
        result["pretrained_mismatched"] = [k for k, v in saved.items() if not torch.equal(state[k], v)]
    del keep

    # Values that contradict the TrainingArguments: one error listing every one of them.
    wrong = {
        **seed002_config(2),
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "fp16": {"enabled": True},
        "bf16": {"enabled": False},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-4, "betas": [0.8, 0.9], "eps": 1e-8, "weight_decay": "auto"},
        },
    }
    try:
        args = training_args(f"{out_dir}/wrong", deepspeed=wrong, steps=STEPS, save_strategy="no")
        Trainer(model=make_model(), args=args, train_dataset=data).train()
        result["mismatch"] = None
    except ValueError as error:
        result["mismatch"] = str(error)
    return result


def train_causal_lm(engine, batches, micro: int) -> list[float]:
    """One optimizer step per global batch of ``batches`` (``[steps, world * micro, seq]`` token
    ids; this rank takes its ``micro`` rows, labels = inputs); each step's loss averaged over
    the ranks."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for ids in batches:
        ids = ids[rank * micro : (rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def plain_causal_lm(model, batches, lr: float) -> list[float]:
    """The single-process fp32 reference: AdamW (weight decay 0) over ``model``'s trainable
    parameters, one step per whole global batch (labels = inputs); the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
