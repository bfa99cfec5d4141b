"""HuggingFace's `Trainer` training a tiny GPT-2 (from `transformers`, a fresh config) on a
local text, with other peers, through `peertrain.Optimizer` (needs `pip install transformers
accelerate`; nothing is downloaded).

    backbone start                          # prints the address to join
    python examples/huggingface_gpt2.py --backbone ADDR --shard 0 --shards 2 --identity a.key
    python examples/huggingface_gpt2.py --backbone ADDR --shard 1 --shards 2 --identity b.key

The text is the source of Python's own `argparse` module, as bytes (a vocabulary of 256);
each peer trains on its own shard of its blocks.
"""

from __future__ import annotations

import argparse
import inspect
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import peertrain
from peertrain.huggingface import trainer_kwargs

BLOCK = 64


def blocks() -> torch.Tensor:
    text = Path(inspect.getsourcefile(argparse) or "").read_bytes()
    usable = len(text) // BLOCK * BLOCK
    return torch.tensor(list(text[:usable]), dtype=torch.long).view(-1, BLOCK)


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # every peer starts from the same weights
    config = GPT2Config(vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def held_out_loss(net: GPT2LMHeadModel, data: torch.Tensor) -> float:
    net.eval()
    with torch.no_grad():
        loss = float(net(input_ids=data[:32], labels=data[:32]).loss)
    net.train()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", required=True, help="address printed by `backbone start`")
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--identity", default="~/.peertrain/hf-gpt2.key")
    parser.add_argument("--checkpoints", default="~/.peertrain/hf-gpt2-checkpoints")
    parser.add_argument("--steps", type=int, default=10, help="collaborative steps to train")
    parser.add_argument("--target-batch", type=int, default=64)
    args = parser.parse_args()

    data = blocks()
    shard = data[args.shard :: args.shards]
    train = [{"input_ids": row, "labels": row} for row in shard]
    net = model()
    before = held_out_loss(net, data)
    with tempfile.TemporaryDirectory() as output:
        training = TrainingArguments(
            output_dir=output, per_device_train_batch_size=8, gradient_accumulation_steps=1,
            max_steps=100_000, save_strategy="no", report_to=[], use_cpu=True,
            logging_steps=5, disable_tqdm=True, dataloader_num_workers=0,
            max_grad_norm=0.0,  # clipping, if any: training.clip_grad_norm (the average)
        )  # fmt: skip
        opt = peertrain.Optimizer(
            net,
            torch.optim.AdamW(net.parameters(), lr=3e-3),
            backbones=[args.backbone],
            name="tiny-gpt2-example",
            batch_size=training.per_device_train_batch_size * training.gradient_accumulation_steps,
            target_batch=args.target_batch,
            config={"identity.path": args.identity, "training.checkpoint_dir": args.checkpoints},
        )
        trainer = Trainer(
            model=net,
            args=training,
            train_dataset=train,
            **trainer_kwargs(opt, max_global_steps=args.steps),
        )
        trainer.train()
        step = opt.global_step
    print(
        f"step {step} of shard {args.shard}: held-out loss {before:.4f} -> "
        f"{held_out_loss(net, data):.4f}"
    )


if __name__ == "__main__":
    main()
