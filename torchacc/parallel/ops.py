"""Op-level strategies, as MindSpore's ``ops.MatMul().shard(((1, 1), (1, 2)))``: callables usable
inside any ``nn.Module.forward`` that compute the plain PyTorch op and, in the semi-auto and auto
modes, lay their inputs out by the strategy first.

Each op names its inputs' dimensions (``MatMul``: ``mk`` and ``kn``): a dimension two inputs share
(the contracted ``k``) must have the same slice count, and gets the same device-matrix axes. The
devices a strategy leaves over split the batch (dimension 0 of the first activation input);
parameters are laid out once and keep that layout (Note [Parallel modes on the sharding engine]).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.parallel import context, layout

_counter = itertools.count()


class Primitive:
    """An op with an optional strategy: one tuple of slice counts per tensor input."""

    num_inputs = 1

    def __init__(self):
        self.strategy = None
        self.name = f"{type(self).__name__}-op{next(_counter)}"

    def labels(self, ranks):
        """Dimension labels of each input (equal labels: the same dimension of the op)."""
        return [tuple(f"x{i}_{d}" for d in range(r)) for i, r in enumerate(ranks)]

    def shard(self, strategy):
        if (
            not isinstance(strategy, (tuple, list))
            or len(strategy) != self.num_inputs
            or not all(isinstance(s, (tuple, list)) for s in strategy)
        ):
            raise ValueError(
                f"{self.name}.shard: expected one strategy tuple per input ({self.num_inputs} "
                f"input(s)), got {strategy!r}"
            )
        strategy = tuple(layout.check_strategy(self.name, s) for s in strategy)
        counts = self._counts(strategy)
        total = math.prod(counts.values())
        n = context.get_group_size()
        if total > n or n % total:
            raise ValueError(
                f"{self.name}: strategy {strategy} uses {total} devices; the job has {n} devices, "
                "and a strategy's slice counts must multiply to a divisor of it"
            )
        self.strategy = strategy
        return self

    def devices_used(self):
        return math.prod(self._counts(self.strategy).values()) if self.strategy else 1

    def _counts(self, strategy):
        counts = {}
        for labels, s in zip(self.labels([len(s) for s in strategy]), strategy):
            for label, c in zip(labels, s):
                if counts.setdefault(label, c) != c:
                    raise ValueError(
                        f"{self.name}: strategy {strategy} splits one dimension of the op "
                        f"({label}) into {counts[label]} and {c} slices; the inputs sharing it "
                        "must agree"
                    )
        return counts

    def __call__(self, *args, **kwargs):
        tensors = list(args[: self.num_inputs])
        if (
            self.strategy is not None
            and context.uses_strategies()
            and any(isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE for t in tensors)
        ):
            self._lay_out(tensors)
        return self.compute(*args, **kwargs)

    def _lay_out(self, tensors):
        matrix = context.device_matrix()
        labels = self.labels([t.dim() for t in tensors])
        for t, s in zip(tensors, self.strategy):
            if len(s) != t.dim():
                raise ValueError(
                    f"{self.name}: strategy {self.strategy} has {len(s)} entries for an input of "
                    f"shape {tuple(t.shape)} (rank {t.dim()})"
                )
        counts = self._counts(self.strategy)
        order = dict(reversed([(la, counts[la]) for lab in labels for la in lab]))
        axes_of, left = layout.assign_axes(self.name, order, matrix)
        activations = [i for i, t in enumerate(tensors) if not layout.is_parameter(t)]
        batch_label = labels[activations[0]][0] if activations and labels[activations[0]] else None
        for t, s, lab in zip(tensors, self.strategy, labels):
            param = layout.is_parameter(t)
            layout.check_against(self.name, s, t.shape, "parameter" if param else "an input")
            batch = left if not param and lab and lab[0] == batch_label else ()
            if batch and t.shape[0] % (s[0] * matrix.size(batch)):
                raise ValueError(
                    f"{self.name}: strategy {self.strategy} leaves {matrix.size(batch)} devices "
                    f"to split the batch dimension of an input of shape {tuple(t.shape)}, and "
                    f"{s[0]} x {matrix.size(batch)} slices do not divide {t.shape[0]}"
                )
            spec = layout.spec_for(lab, axes_of, batch)
            if param:
                layout.place_parameter(t, self.name, s, spec, matrix)
            else:
                layout.constrain(t, spec, self.name, matrix)

    def compute(self, *args, **kwargs):
        raise NotImplementedError


class MatMul(Primitive):
    """``x @ w`` for a 2-D ``w`` (``x`` may have leading batch dimensions)."""

    num_inputs = 2

    def __init__(self, transpose_a=False, transpose_b=False):
        super().__init__()
        self.transpose_a, self.transpose_b = transpose_a, transpose_b

    def labels(self, ranks):
        lead = tuple(f"b{i}" for i in range(ranks[0] - 2))
        x = lead + (("k", "m") if self.transpose_a else ("m", "k"))
        return [x, ("n", "k") if self.transpose_b else ("k", "n")]

    def compute(self, x, w):
        if self.transpose_a:
            x = x.transpose(-1, -2)
        return x @ (w.t() if self.transpose_b else w)


class BatchMatMul(Primitive):
    """``x @ y`` over batches (batch dimensions aligned from the right)."""

    num_inputs = 2

    def labels(self, ranks):
        out = []
        for r, tail in zip(ranks, (("m", "k"), ("k", "n"))):
            out.append(tuple(f"b{r - 2 - d}" for d in range(r - 2)) + tail)
        return out

    def compute(self, x, y):
        return torch.matmul(x, y)


class _Elementwise(Primitive):
    num_inputs = 2

    def labels(self, ranks):
        return [tuple(f"e{r - d}" for d in range(r)) for r in ranks]


class Add(_Elementwise):
    def compute(self, x, y):
        return x + y


class Mul(_Elementwise):
    def compute(self, x, y):
        return x * y


class Softmax(Primitive):
    def __init__(self, axis=-1):
        super().__init__()
        self.axis = axis

    def compute(self, x):
        return torch.softmax(x, self.axis)


class Gelu(Primitive):
    def __init__(self, approximate="none"):
        super().__init__()
        self.approximate = approximate

    def compute(self, x):
        return F.gelu(x, approximate=self.approximate)


class ReLU(Primitive):
    def compute(self, x):
        return torch.relu(x)


class ReduceSum(Primitive):
    """``ReduceSum(keep_dims)(x, axis)`` as MindSpore; ``axis=()`` sums everything."""

    def __init__(self, keep_dims=False):
        super().__init__()
        self.keep_dims = keep_dims

    def compute(self, x, axis=()):
        if axis == () or axis is None:
            return x.sum().reshape((1,) * x.dim()) if self.keep_dims else x.sum()
        return x.sum(dim=axis, keepdim=self.keep_dims)


class Gather(Primitive):
    """``Gather()(params, indices, axis)``: rows of an embedding table (``axis=0``)."""

    num_inputs = 2

    def labels(self, ranks):
        return [tuple(f"t{d}" for d in range(ranks[0])), tuple(f"i{d}" for d in range(ranks[1]))]

    def compute(self, params, indices, axis=0):
        if axis == 0:
            return F.embedding(indices, params)
        return torch.index_select(params, axis, indices.reshape(-1)).reshape(
            params.shape[:axis] + indices.shape + params.shape[axis + 1 :]
        )
