"""``torch_xla.experimental.gradient_accumulation`` on torchacc: the accumulation steps as one
``lax.while_loop`` (torchacc/lazy/region.py), forward and backward traced once into its body.

Each iteration takes slice ``i`` of the iterable tensors, runs ``train_step`` with the model's
parameters as graph inputs, differentiates ``loss / steps`` with respect to those that require
grad and adds the gradients and the loss to the loop's accumulators; the carried tensors go to
the next iteration. After the loop the gradients are added into ``param.grad``. Random ops inside
``train_step`` get a fresh key per iteration.
"""

from __future__ import annotations

import torch

from torchacc.lazy import region
from torchacc.torch_xla._api import differs


@differs(
    "train_step's random ops draw from torchacc's device RNG (a fresh key per iteration), not "
    "from torch_xla's seeds; buffers the model writes (batch norm statistics) are refused"
)
def gradient_accumulation(train_step, iterable_tensors, model, *carried_tensors):
    """``train_step(*slices, *carried) -> loss or (loss, *carried)`` over the leading dimension
    of ``iterable_tensors``; returns the accumulated ``loss`` (sum of ``loss / steps``) and the
    final carried tensors, and adds the accumulated gradients into the parameters' ``.grad``."""
    if not iterable_tensors:
        raise ValueError("gradient_accumulation: iterable_tensors cannot be empty")
    steps = iterable_tensors[0].size(0)
    for i, t in enumerate(iterable_tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"gradient_accumulation: element {i} of iterable_tensors is not a tensor"
            )
        if t.numel() == 0:
            raise ValueError(f"gradient_accumulation: element {i} of iterable_tensors is empty")
        if t.size(0) != steps:
            raise ValueError(
                f"gradient_accumulation: element {i} of iterable_tensors has leading dimension "
                f"{t.size(0)}, element 0 has {steps}"
            )
    named = list(model.named_parameters())
    trained = [i for i, (_, p) in enumerate(named) if p.requires_grad]
    xs, params, carried = list(iterable_tensors), [p for _, p in named], list(carried_tensors)
    device = xs[0].device
    nx, ng, nc = len(xs), len(trained), len(carried)

    def body(i, loss, *rest):
        grads, state = rest[:ng], rest[ng : ng + nc]
        at = i.reshape(1)  # a device index (x[i] would read i on the host)
        slices = [x.index_select(0, at).squeeze(0) for x in rest[ng + nc : ng + nc + nx]]
        ps = rest[ng + nc + nx :]
        with torch.nn.utils.stateless._reparametrize_module(
            model, {name: p for (name, _), p in zip(named, ps)}
        ):
            result = train_step(*slices, *state)
        step_loss, *new_state = result if nc else (result,)
        if len(new_state) != nc:
            raise ValueError(
                f"gradient_accumulation: train_step returned {len(new_state)} carried tensors "
                f"for {nc} given"
            )
        step_loss = step_loss / steps
        wrt = [ps[k] for k in trained]
        step_grads = torch.autograd.grad(step_loss, wrt, allow_unused=True) if wrt else ()
        grads = [a if g is None else a + g for a, g in zip(grads, step_grads)]
        new_state = [s.detach() for s in new_state]
        return (i + 1, loss + step_loss.detach().to(loss.dtype), *grads, *new_state)

    def cond(i, *rest):
        return i < steps

    with torch.no_grad():
        init = (
            torch.zeros((), dtype=torch.int32, device=device),
            torch.zeros((), dtype=torch.float32, device=device),
            *[torch.zeros_like(params[k]) for k in trained],
            *carried,
        )
        try:
            _, loss, *outs = region.while_loop(
                cond, body, init, [*xs, *params], grad_inputs=[nx + k for k in trained]
            )
        except ValueError as e:
            if "writes in place into its input" not in str(e):
                raise
            raise AssertionError(f"gradient_accumulation: train_step must be pure: {e}") from None
    for k, g in zip(trained, outs[:ng]):
        p = params[k]
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
    return (loss, *outs[ng:]) if nc else loss


__all__ = ["gradient_accumulation"]
