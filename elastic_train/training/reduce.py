"""The exact gradient reduction (`train.grad_reduce=exact`): a float64 sum that does not depend on
the world size, so a step's update is the same to the bit on 1 or N ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_train.training.collectives import is_distributed, timed_all_reduce


class ExactGradSum:
    """World-size-invariant gradient reduction (`train.grad_reduce=exact`).

    A micro-batch's gradient does not depend on the world size: the same rows, the same weights.
    What does is the order in which they are summed: one rank adds 8 of them in turn, two ranks add
    4 each and then each other's sums, and fp32 rounds differently. Here each micro-batch's gradient
    is added to a float64 buffer as soon as its backward ends, and the buffers are all-reduced in
    float64: a sum of fp32 numbers in float64 is exact, or off by 2**-53 relative, far below the
    2**-24 of the final cast back to fp32, so the gradient comes out the same to the bit whatever the
    order. The model is not wrapped in DDP on this path; there is one all-reduce per step.

    Exact, precisely, while one parameter's K summands span fewer than about 28 - log2(K) binary
    orders of magnitude (24 significant bits each, 53 in float64). Beyond that float64 rounds, and
    the fp32 result then depends on the order when the exact sum lies within that rounding of an
    fp32 rounding boundary: roughly K * 2**-28 per rounded element. We measured how often float64
    rounds at all (benchmarks/reduce.py, BENCHMARKS.md) and keep float64 rather than an int64
    fixed-point sum, which is order-independent by construction but needs its shared exponent (a
    MAX all-reduce over every micro-batch's gradient) before the first micro-batch is added: that
    means holding every micro-batch's gradient, or a second backward, or redoing a step whose
    gradient outgrew a guessed exponent; and one exponent per tensor drops the low bits of its
    small elements, which the fp32 gradient keeps.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, extra: int = 0) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        # `extra` float64 slots after the gradients: numbers that ride in the same all-reduce
        # (in-place recovery reduces everything of a step in one fault-tolerant collective)
        self.buffer = torch.zeros(numel + extra, dtype=torch.float64, device=device)
        self.flat, self.extra = self.buffer[:numel], self.buffer[numel:]
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def add_grads(self) -> None:
        """Move the gradients of the backward that just ended into the float64 sum: one foreach
        call (on a GPU, a few launches for all parameters rather than one per parameter), the
        same element-wise adds as `acc.add_(grad)` each."""
        pairs = [(acc, p.grad) for p, acc in zip(self.params, self.views, strict=True)
                 if p.grad is not None]
        if pairs:
            torch._foreach_add_([acc for acc, _ in pairs], [grad for _, grad in pairs])
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """All-reduce the sums and leave them in `.grad` (fp32), ready for clipping and the step."""
        if is_distributed():
            timed_all_reduce(self.flat)
        self.set_grads()

    def set_grads(self, divisor: float | None = None) -> None:
        """The (reduced) sums, divided by `divisor` in float64 if given, into `.grad`; the
        buffer is zeroed for the next step."""
        for p, acc in zip(self.params, self.views, strict=True):
            p.grad = (acc if divisor is None else acc / divisor).to(p.dtype, copy=True)
        self.buffer.zero_()

    @staticmethod
    def broadcast_parameters(model: torch.nn.Module) -> None:
        """Start every rank from rank 0's weights, as DDP's constructor does."""
        if is_distributed():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)


def rescale_grads(model: torch.nn.Module, factor: float) -> None:
    """Multiply every gradient by `factor` (a loss counted other targets than the data's), in
    its own dtype, except a float64 gradient holding float32 values (exact fsdp: its shard of
    this rank, a DTensor's local part), multiplied as float32 and stored back, so that the
    products are those of the unsharded model's float32 gradients to the bit."""
    for p in model.parameters():
        grad = p.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.dtype == torch.float64 and hasattr(grad, "to_local"):
            local.copy_(local.to(torch.float32).mul_(factor))
        else:
            local.mul_(factor)
