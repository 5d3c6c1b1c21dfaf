"""TRL's trainers as a user runs them, on a tiny GPT-2 built from its config (nothing downloaded).

Run by ``accelerate launch [--config_file cfg.yaml] tests/hf/trl_flows.py TRAINERS OUTPUT_DIR MODEL_DIR``
(``torchrun --nproc_per_node 2 tests/hf/trl_flows.py TRAINERS OUTPUT_DIR MODEL_DIR ddp`` for DDP; a path
instead of ``ddp`` hands that DeepSpeed config to the Trainer; BACKENDS comma-separated, one for
each of the comma-separated TRAINERS, mixes them in one launch)
(``python tests/hf/trl_flows.py save MODEL_DIR``, or ``save_initial_model``, writes the initial model
first), under ``python -m zerotrain.hf`` for the DeepSpeed configs (tests/hf/test_trl.py runs its
DDP trainers there too, before the DeepSpeed ones). Prints one line
``RESULT {json}`` on the main process: every logged value (loss, rewards, KL, ...), the engine's
class and ZeRO stage, and a checksum of the trained weights.
"""

from __future__ import annotations

import json
import sys

import torch

VOCAB = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [" ", ".", "?"]
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


def tokenizer():
    """A character-level fast tokenizer built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def model(vocab_size: int, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config)


WORDS = ["cat", "dog", "sun", "map", "red", "big", "hat", "cup", "pen", "box", "top", "leg"]


def _prompts(count: int) -> list[str]:
    return [f"{WORDS[i % len(WORDS)]} {WORDS[(3 * i + 1) % len(WORDS)]}" for i in range(count)]


def dataset(kind: str):
    from datasets import Dataset

    prompts = _prompts(16)
    if kind == "sft":
        return Dataset.from_dict({"prompt": prompts, "completion": [p[::-1] + "." for p in prompts]})
    if kind == "dpo":
        return Dataset.from_dict(
            {"prompt": prompts, "chosen": [p[::-1] + "." for p in prompts], "rejected": [p + "?" for p in prompts]}
        )
    if kind == "kto":
        return Dataset.from_dict(
            {
                "prompt": prompts + prompts,
                "completion": [p[::-1] + "." for p in prompts] + [p + "?" for p in prompts],
                "label": [True] * len(prompts) + [False] * len(prompts),
            }
        )
    if kind == "grpo":
        return Dataset.from_dict({"prompt": prompts})
    raise ValueError(kind)


def vowel_reward(completions, **_):
    """A reward that varies between samples: the share of vowels in each completion."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


# SGD beside AdamW: AdamW's update of a parameter whose gradient is rounding noise (GPT-2's key
# bias) is +-lr whatever the noise, so its weights are compared by norm only; SGD's by every sum.
OPTIMIZERS = {"sft": ("adamw_torch", 1e-2), "dpo": ("sgd", 0.5), "kto": ("sgd", 0.5), "grpo": ("adamw_torch", 1e-2)}
COMMON = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    max_steps=3,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    seed=0,
    data_seed=0,
    bf16=False,
    fp16=False,
    lr_scheduler_type="constant",
    dataloader_drop_last=True,
    disable_tqdm=True,
)


def save_initial_model(path: str) -> None:
    """The policy's initial weights and tokenizer as a folder, which GRPO (beta > 0) builds its
    reference model from, as a user's model name."""
    tok = tokenizer()
    model(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)


def trainer(kind: str, output_dir: str, model_dir: str, backend: str):
    """``backend``: "ddp" (the Trainer's DDP over gloo under torchrun: ``use_cpu``), "deepspeed"
    (accelerate's DeepSpeed plugin from ``accelerate launch``), or a DeepSpeed config file given to
    the Trainer (``deepspeed=PATH``)."""
    import trl
    from transformers import AutoModelForCausalLM

    optim, lr = OPTIMIZERS[kind]
    COMMON.update(
        use_cpu=backend == "ddp",
        optim=optim,
        learning_rate=lr,
        deepspeed=None if backend in ("ddp", "deepspeed") else backend,
    )
    tok = tokenizer()
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    data = dataset(kind)
    if kind == "sft":
        args = trl.SFTConfig(output_dir=output_dir, max_length=32, **COMMON)
        return trl.SFTTrainer(model=policy, args=args, train_dataset=data, processing_class=tok)
    if kind == "dpo":
        args = trl.DPOConfig(output_dir=output_dir, max_length=32, beta=0.1, **COMMON)
        return trl.DPOTrainer(
            model=policy, ref_model=model(len(tok), seed=1), args=args, train_dataset=data, processing_class=tok
        )
    if kind == "kto":
        args = trl.KTOConfig(output_dir=output_dir, max_length=32, beta=0.1, **COMMON)
        return trl.KTOTrainer(
            model=policy, ref_model=model(len(tok), seed=1), args=args, train_dataset=data, processing_class=tok
        )
    if kind == "grpo":
        args = trl.GRPOConfig(
            output_dir=output_dir, beta=0.1, num_generations=2, max_completion_length=6, temperature=1.0, **COMMON
        )
        return trl.GRPOTrainer(
            model=model_dir, reward_funcs=vowel_reward, args=args, train_dataset=data, processing_class=tok
        )
    raise ValueError(kind)


def main(kinds: str, output_dir: str, model_dir: str, backend: str = "deepspeed") -> None:
    """Train each of the comma-separated trainers in turn, in this one process group. ``backend``
    is one for all, or comma-separated, one for each trainer (DDP and DeepSpeed config files in
    one launch: each launch's start costs as much as two trainers)."""
    backends = backend.split(",") if "," in backend else [backend] * len(kinds.split(","))
    assert len(backends) == len(kinds.split(",")), (kinds, backend)
    for index, (kind, each) in enumerate(zip(kinds.split(","), backends)):
        train(kind, f"{output_dir}/{index}-{kind}", model_dir, each)


def train(kind: str, output_dir: str, model_dir: str, backend: str) -> None:
    run = trainer(kind, output_dir, model_dir, backend)
    run.train()
    engine = run.model_wrapped
    logs = [
        {k: v for k, v in entry.items() if isinstance(v, (int, float))}
        for entry in run.state.log_history
        if "train_runtime" not in entry
    ]
    unwrapped = run.accelerator.unwrap_model(run.model)
    stage = getattr(engine, "zero_optimization_stage", lambda: None)()
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
            checksum = _checksum(unwrapped)
    else:
        checksum = _checksum(unwrapped)
    if run.accelerator.is_main_process:
        print(
            "RESULT "
            + json.dumps(
                {
                    "trainer": kind,
                    "optim": OPTIMIZERS[kind][0],
                    "engine": type(engine).__module__,
                    "stage": stage,
                    "world": run.accelerator.num_processes,
                    "logs": logs,
                    "weights": checksum,
                }
            ),
            flush=True,
        )


def _checksum(module) -> list[float]:
    """Each parameter's norm and sum (in float64): two numbers a weight difference moves."""
    return [float(v) for p in module.parameters() for v in (p.detach().double().norm(), p.detach().double().sum())]


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save_initial_model(sys.argv[2])
    else:
        main(*sys.argv[1:5])
