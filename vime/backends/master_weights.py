"""bf16 training with fp32 master weights: the trainers' ``dtype="bf16"``.

The model's parameters are bf16, so forward and backward run bf16 kernels
without autocast re-casting every weight on every micro-batch (on an H200
that re-casting cost more than the 45 % MFU goal allowed, see
``bench/train.py``). Each parameter has an fp32 master copy; the optimizer
steps the masters, and :meth:`MasterWeights.publish` rounds them back into
the bf16 parameters. Gradients accumulate in fp32 on the masters: a hook
moves each bf16 gradient there as soon as backward has produced it, so
micro-batches never sum in bf16 and no bf16 gradient outlives its layer's
backward. This is what Megatron's mixed-precision optimizer does
(``Float16OptimizerWithFloat16Params``, with
``accumulate_allreduce_grads_in_fp32``), in a form that also runs on CPU and
serves a transformers model as well as a megatron-core one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def to_bf16(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Turn ``module``'s parameters into bf16 in place (buffers, like RoPE frequencies, keep their dtype);
    the parameters, in ``parameters()`` order."""
    params = list(module.parameters())
    for param in params:
        param.data = param.data.to(torch.bfloat16)
    return params


class MasterWeights:
    """fp32 masters of a set of parameters that this turns into bf16; the optimizer takes :attr:`groups`
    (one list per module, the masters of its trainable parameters in ``parameters()`` order)."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.groups: list[list[torch.Tensor]] = []
        self._pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for module in modules:
            group = []
            trainable = [param for param in module.parameters() if param.requires_grad]
            masters = [self._master(param) for param in trainable]
            to_bf16(module)
            for param, (master, gradient_holder) in zip(trainable, masters):
                param.register_post_accumulate_grad_hook(_move_gradient(gradient_holder))
                self._pairs.append((param, master))
                group.append(gradient_holder)
            self.groups.append(group)

    def _master(self, param: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 master of ``param`` (called while it is still fp32) and the tensor of its shape whose
        ``.grad`` accumulates ``param``'s gradient in fp32, which the optimizer takes: here the master itself;
        a subclass that keeps part of each master (``distributed_optimizer``) answers otherwise."""
        master = param.detach().to(torch.float32, copy=True)
        return master, master

    @torch.no_grad()
    def publish(self) -> None:
        """Round the masters into the bf16 parameters (after each optimizer step, and after a load)."""
        if self._pairs:
            torch._foreach_copy_([param for param, _ in self._pairs], [master for _, master in self._pairs])

    def state_dict(self) -> list[torch.Tensor]:
        return [master for _, master in self._pairs]

    @torch.no_grad()
    def load_state_dict(self, masters: list[torch.Tensor]) -> None:
        if [tuple(saved.shape) for saved in masters] != [tuple(master.shape) for _, master in self._pairs]:
            raise ValueError(f"the checkpoint's {len(masters)} master weights do not fit this model's "
                             f"{len(self._pairs)}: it was saved from another model or another parallel layout")
        for (_, master), saved in zip(self._pairs, masters):
            master.copy_(saved)
        self.publish()


def _move_gradient(holder: torch.Tensor) -> Callable[[torch.nn.Parameter], None]:
    def move(param: torch.nn.Parameter) -> None:
        if holder.grad is None:
            holder.grad = param.grad.to(torch.float32)
        else:
            holder.grad.add_(param.grad)
        param.grad = None
    return move
