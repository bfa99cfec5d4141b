"""A plain PyTorch training loop that trains with other peers: a DataLoader over this peer's
shard of a dataset, the model, AdamW, and `peertrain.Optimizer` around it.

    backbone start                          # prints the address to join
    python examples/plain_loop.py --backbone ADDR --shard 0 --shards 2 --identity a.key
    python examples/plain_loop.py --backbone ADDR --shard 1 --shards 2 --identity b.key

The dataset is a synthetic regression (a fixed random linear map plus noise), so the example
needs nothing to download; each peer reads only its own shard of it.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import peertrain


def dataset(size: int = 4096) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)  # every peer builds the same dataset
    x = torch.randn(size, 32, generator=generator)
    y = x @ torch.randn(32, 4, generator=generator) + 0.01 * torch.randn(
        size, 4, generator=generator
    )
    return TensorDataset(x, y)


def model() -> nn.Module:
    torch.manual_seed(0)  # every peer starts from the same weights
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))


def mean_loss(net: nn.Module, data: TensorDataset) -> float:
    with torch.no_grad():
        x, y = data.tensors
        return float(nn.functional.mse_loss(net(x), y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", required=True, help="address printed by `backbone start`")
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--identity", default="~/.peertrain/plain-loop.key")
    parser.add_argument("--checkpoints", default="~/.peertrain/plain-loop-checkpoints")
    parser.add_argument("--steps", type=int, default=20, help="collaborative steps to train")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--target-batch", type=int, default=256)
    args = parser.parse_args()

    data = dataset()
    shard = Subset(data, range(args.shard, len(data), args.shards))  # this peer's samples
    loader = DataLoader(shard, batch_size=args.batch_size, shuffle=True, drop_last=True)
    net = model()
    initial = mean_loss(net, data)
    opt = peertrain.Optimizer(
        net,
        torch.optim.AdamW(net.parameters(), lr=1e-2),
        backbones=[args.backbone],
        name="plain-loop-example",
        batch_size=args.batch_size,
        target_batch=args.target_batch,
        config={"identity.path": args.identity, "training.checkpoint_dir": args.checkpoints},
    )
    with opt:
        epoch = 0
        while opt.global_step < args.steps:
            for x, y in loader:
                loss = nn.functional.mse_loss(net(x), y)
                loss.backward()
                opt.step(batch_size=len(x), loss=loss)
                opt.zero_grad()
                if opt.global_step >= args.steps:
                    break
            epoch += 1
        print(
            f"step {opt.global_step} after {epoch} epochs of shard {args.shard}: "
            f"loss {initial:.4f} -> {mean_loss(net, data):.4f}"
        )


if __name__ == "__main__":
    main()
