"""Seed 002's ``train.py``: the Trainer with ``--deepspeed ds_config.json``, nothing zerotrain in it.

Run as ``deepspeed --num_gpus=2 seed002_train.py --deepspeed ds_config.json
--per_device_train_batch_size 2 --gradient_accumulation_steps 4 --output_dir OUT`` (seed 002's
command) after ``python -m zerotrain.hf install``, or with ``zerotrain`` for ``deepspeed``
(tests/hf/test_switch.py). The repository root comes from ``ZEROTRAIN_REPO`` (for tests.hf's tiny
model and data). ``--use_cpu`` sets ``TrainingArguments(use_cpu=True)``. Rank 0 prints one
``RESULT {json}`` line: the engine's class, its stage, the Trainer's accelerate distributed type and
the per-step losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    sys.path.insert(0, os.environ["ZEROTRAIN_REPO"])
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--use_cpu", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher appends it
    args = parser.parse_args()

    from transformers import Trainer

    from tests.hf.hf_workloads import STEPS, TokenDataset, losses, make_model, training_args

    training = training_args(
        args.output_dir,
        deepspeed=args.deepspeed,
        per_device=args.per_device_train_batch_size,
        steps=STEPS,
        save_strategy="no",
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        use_cpu=args.use_cpu,
    )
    trainer = Trainer(model=make_model(), args=training, train_dataset=TokenDataset(16 * STEPS))
    trainer.train()
    engine = trainer.model_wrapped
    if training.process_index == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "engine": type(engine).__module__ + "." + type(engine).__name__,
                    "stage": engine.zero_optimization_stage(),
                    "world": training.world_size,
                    "distributed_type": str(trainer.accelerator.distributed_type),
                    "losses": losses(trainer),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
