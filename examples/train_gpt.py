"""Train a small GPT on the Python standard library's source code with zerotrain.

    zerotrain launch --nproc 2 examples/train_gpt.py --deepspeed_config examples/ds_config.json
    zerotrain launch --nproc 2 examples/train_gpt.py --deepspeed_config examples/ds_config.json --resume

It saves a checkpoint every ``--save_interval`` steps under ``--save_dir`` (``--resume`` goes on
from the newest one, on any number of processes and ZeRO stage, and starts from step 0 when
``--save_dir`` holds no checkpoint yet, so ``zerotrain launch --max_restarts 3 ... --resume`` is
the one command of an elastic run) and ends by printing a short sample the trained model writes.

Written exactly as a DeepSpeed script would be (swap the import for ``import deepspeed``):
argparse with ``add_config_arguments``, ``initialize`` building the optimizer, scheduler and
distributed dataloader from the JSON config, and the engine's forward/backward/step loop.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from tqdm import tqdm

import zerotrain
from zerotrain.models import GPT, GPTConfig, PythonSourceText, TokenBlocks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=800, help="optimizer steps to train")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--text_bytes", type=int, default=3_000_000, help="how much stdlib source to train on")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save_dir", default="checkpoints/train_gpt", help="where checkpoints go ('' to save none)")
    parser.add_argument("--save_interval", type=int, default=200, help="save every N steps")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from save_dir's newest checkpoint (from step 0 when it holds none yet)",
    )
    parser.add_argument("--sample_bytes", type=int, default=200, help="length of the final sample")
    parser = zerotrain.add_config_arguments(parser)
    return parser.parse_args()


def holds_checkpoint(save_dir: str) -> bool:
    """Whether ``save_dir`` has anything a save left: its ``latest`` file or a checkpoint folder
    (one with ``metadata.json``). An interrupted first save leaves only a hidden ``.<tag>.partial``
    folder, which is nothing. Anything else goes to ``load_checkpoint``, whose error names what
    is wrong (a damaged ``latest``, a checkpoint folder without ``latest``, a missing file)."""
    if not save_dir or not os.path.isdir(save_dir):
        return False
    if os.path.lexists(os.path.join(save_dir, "latest")):
        return True
    return any(
        os.path.isfile(os.path.join(save_dir, name, "metadata.json"))
        for name in os.listdir(save_dir)
        if not name.endswith(".partial")
    )


class _LineWriter:
    """tqdm output as whole lines when stdout is not a terminal (e.g. under `zerotrain launch`,
    which forwards complete lines only), so the progress bar still shows as it advances."""

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            sys.stdout.write(text + "\n")

    def flush(self) -> None:
        sys.stdout.flush()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    text = PythonSourceText(max_bytes=args.text_bytes)
    dataset = TokenBlocks(text.tokens, args.seq_len)
    model = GPT(
        GPTConfig(
            vocab_size=256, n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head
        )
    )

    engine, _, loader, _ = zerotrain.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )

    rank0 = engine.global_rank == 0
    if args.resume and not holds_checkpoint(args.save_dir):
        # The first attempt of an elastic run (`--resume --max_restarts N` as its one command).
        if rank0:
            print(f"--resume: {args.save_dir!r} holds no checkpoint yet; starting from step 0")
    elif args.resume:
        path, _ = engine.load_checkpoint(args.save_dir)
        if rank0:
            print(f"resumed from {path} at step {engine.global_steps}")
    if rank0:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"model: {n_params / 1e6:.2f}M parameters | data: {len(dataset)} blocks of "
            f"{args.seq_len} bytes | ranks: {engine.dp_world_size} | ZeRO stage "
            f"{engine.zero_optimization_stage()} | global batch {engine.train_batch_size()}"
        )

    tty = sys.stdout.isatty()
    progress = tqdm(
        total=args.steps,
        initial=engine.global_steps,
        disable=not rank0,
        unit="step",
        dynamic_ncols=tty,
        file=sys.stdout if tty else _LineWriter(),
        mininterval=0.1 if tty else 10,
    )
    start, first_loss, recent, start_samples = time.perf_counter(), None, [], engine.global_samples
    while engine.global_steps < args.steps:
        for batch in loader:
            input_ids = batch["input_ids"].to(engine.device)
            labels = batch["labels"].to(engine.device)
            loss = engine(input_ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
            recent = (recent + [loss.item()])[-20:]
            if engine.was_step_applied():
                first_loss = first_loss if first_loss is not None else loss.item()
                progress.update(1)
                progress.set_postfix(
                    loss=f"{sum(recent) / len(recent):.3f}", refresh=False, lr=f"{engine.get_lr()[0]:.2e}"
                )
                if args.save_dir and engine.global_steps % args.save_interval == 0:
                    engine.save_checkpoint(args.save_dir)
            if engine.global_steps >= args.steps:
                break
    progress.close()
    if args.save_dir and engine.global_steps % args.save_interval:
        engine.save_checkpoint(args.save_dir)  # the final state too
    if rank0 and recent:
        final = sum(recent) / len(recent)
        elapsed = time.perf_counter() - start
        print(
            f"done: {engine.global_steps} steps in {elapsed:.0f} s | loss {first_loss:.3f} -> "
            f"{final:.3f} (uniform guess: {math.log(256):.3f}) | "
            f"{(engine.global_samples - start_samples) / elapsed:.1f} samples/s"
        )
    text = generate(engine, b"def ", args.sample_bytes, args.seq_len)
    if rank0:
        print("sample:\n" + text)


@torch.no_grad()
def generate(engine, prompt: bytes, length: int, context: int, temperature: float = 0.8) -> str:
    """Sample ``length`` bytes after ``prompt``. Every rank runs it (at ZeRO stage 3 each
    forward gathers the weights from all ranks); a shared seed keeps the ranks' samples equal."""
    engine.eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    for _ in range(length):
        logits = engine(ids[:, -context:].to(engine.device)).logits[0, -1].float().cpu()
        probs = torch.softmax(logits / temperature, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator).view(1, 1)], dim=1)
    engine.train()
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


if __name__ == "__main__":
    main()
