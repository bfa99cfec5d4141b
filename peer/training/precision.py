"""Mixed precision of the local forward and backward passes (`training.precision`).

- `fp32`: as the task's model is.
- `bf16`: forward under `torch.autocast(dtype=bfloat16)`; bf16 keeps fp32's exponent range, so
  no loss scaling.
- `fp16`: forward under `torch.autocast(dtype=float16)`, backward of the loss scaled by torch's
  `GradScaler`, so small gradients do not flush to zero. The gradients are unscaled before they
  are accumulated (in float32) or stepped on, and a micro-batch whose gradients overflow is
  skipped (its samples are not counted) while the scaler backs off, as in plain AMP training.

The scale is each peer's own and never reaches the network: what a peer contributes to an
averaging is unscaled, so peers with different scales (one backed off after an overflow, one
that has just joined) still average true gradients, and the applied step is the same on all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PRECISIONS = ("fp32", "bf16", "fp16")


class Precision:
    def __init__(self, name: str, device: torch.device) -> None:
        assert name in PRECISIONS, name
        self.name = name
        self.device_type = device.type
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        """`loss.backward()` into the `.grad` of `optimizer`'s parameters, unscaled; False if
        they overflowed (fp16: the micro-batch is to be skipped; the scaler has backed off)."""
        if self.scaler is None:
            loss.backward()
            return True
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(optimizer)
        finite = all(
            bool(torch.isfinite(p.grad).all())
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        )
        self.scaler.update()  # halves the scale after an overflow, grows it after a streak
        return finite

    def step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        """A local optimizer step on `loss` (diloco's inner step); False if fp16 skipped it.
        The gradients go after the step: kept until the next, they were a model's worth of
        memory through every averaging (0.4 GB at 100 M)."""
        optimizer.zero_grad(set_to_none=True)
        try:
            if self.scaler is None:
                loss.backward()
                optimizer.step()
                return True
            self.scaler.scale(loss).backward()
            scale = self.scaler.get_scale()
            self.scaler.step(optimizer)  # skipped (and the scale lowered) if one overflowed
            self.scaler.update()
            return self.scaler.get_scale() >= scale
        finally:
            optimizer.zero_grad(set_to_none=True)
