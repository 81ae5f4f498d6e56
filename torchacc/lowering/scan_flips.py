"""Graph rewrites that remove the ``flip`` copies torch's scan autograd puts around its backward
scan (the trace-once frontend's ``higher_order.scan``): the backward scan reads the forward's
stacks in reverse and writes the gradient stacks in reverse instead.

Note [Reversed backward scans]
torch's scan autograd (torch/_higher_order_ops/scan.py, 2.13) builds the backward as a forward
``scan_op`` over ``flip(x, [0])`` of every stacked input (the forward's saved per-step
activations, the saved xs, the output gradients) and flips every stacked gradient it returns.
``aten.flip`` is a copy of the whole stack, and XLA does not fold it into the while loop's
per-step slices: at depth 8 of the gallery GPT (n_embd 128) these copies were most of the steady
step's gap to the unrolled loop (Issue 32, benchmarks/RESULTS.md). ``lax.scan(reverse=True)``
reads step ``i`` at index ``n - 1 - i`` and stacks its outputs at that index, i.e. it is
``flip(scan(flip(xs)).ys)`` without the copies. So:

- ``reverse_flipped_scans(graph)`` (run on every graph torchacc lowers, lower.py) replaces a
  ``higher_order.scan`` whose xs are all ``flip(a, [0])`` by ``scan_reversed`` over the ``a``s;
  a stacked output whose reader is ``flip(y, [0])`` feeds that reader's users directly, any other
  reader gets the flip back (same values either way; a flip left without readers is dropped).
  compile_step's single graph holds the forward scan, the flips and the backward scan together,
  so this removes all of them.
- ``unflip_saved(fw, bw, n)`` (torch.compile's partition, dynamo/aot.py) handles the one place the
  flips cross a graph boundary: AOTAutograd's forward graph saves ``flip(stack)`` for the backward
  graph. The forward saves ``stack`` instead and the backward starts with the flip (the saved
  value is matched by name: the partitioner names a saved node's backward placeholder after it);
  the backward graph's scan then reads ``stack`` reversed as above.

Both are exact (no arithmetic changes: results are the same bits). The forward scan, the graphs'
node counts and the number of compiled programs are unchanged; the steady step and the memory
traffic shrink by the flips' copies. tests/test_scan_dynamo.py checks the lowered programs hold no
``reverse`` of a stacked array.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from torchacc.lowering.fx_calling import HOP_RULES

_flip = torch.ops.aten.flip.default


def _is_flip0(node):
    """``aten.flip(x, [0])``: a reversal of the stacked (leading) dimension only."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is _flip):
        return False
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dims")
    return list(dims) in ([0], [-len(node.meta["val"].shape)]) if "val" in node.meta else False


def scan_reversed(combine_fn, init, xs, additional_inputs):
    """``flip(scan_op(combine_fn, init, flip(xs)).ys)``, carries as they are, as one reverse
    ``lax.scan`` (Note [Reversed backward scans])."""
    from torchacc.lowering.scan import _hop_scan

    return _hop_scan(combine_fn, init, xs, additional_inputs, reverse=True)


HOP_RULES[scan_reversed] = scan_reversed


def reverse_flipped_scans(graph):
    """Rewrite ``graph``'s scans over flipped stacks into ``scan_reversed`` (in place); returns
    the number of scans rewritten."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.higher_order.scan:
            continue
        combine, init, xs, extra = node.args
        if not xs or not all(_is_flip0(x) for x in xs):
            continue
        with graph.inserting_after(node):
            new = graph.call_function(
                scan_reversed, (combine, init, [x.args[0] for x in xs], extra), {}
            )
        new.meta = dict(node.meta)
        n_carry = len(init)
        for use in list(node.users):
            if use.target is not operator.getitem:
                raise AssertionError(f"torchacc: scan output read by {use.format_node()}")
            with graph.inserting_after(new):
                item = graph.call_function(operator.getitem, (new, use.args[1]))
            item.meta = dict(use.meta)
            if use.args[1] >= n_carry:  # a stacked output: stacked in reverse by scan_reversed
                for reader in list(use.users):
                    if _is_flip0(reader):
                        reader.replace_all_uses_with(item)
                        graph.erase_node(reader)
                if use.users:
                    with graph.inserting_after(item):
                        back = graph.call_function(_flip, (item, [0]))
                    back.meta = dict(use.meta)
                    use.replace_all_uses_with(back)
            else:
                use.replace_all_uses_with(item)
            graph.erase_node(use)
        graph.erase_node(node)
        for x in xs:
            if not x.users:
                graph.erase_node(x)
        done += 1
    return done


def unflip_saved(fw, bw, num_fwd_outputs):
    """AOTAutograd's forward graph module ``fw`` saves ``flip(stack, [0])`` for ``bw``: save
    ``stack`` and flip it at the start of ``bw`` instead, so ``bw``'s scan can read it reversed
    (Note [Reversed backward scans]). Both modules are changed in place."""
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = list(out.args[0])
    places = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    changed = False
    for i in range(num_fwd_outputs, len(outs)):
        o = outs[i]
        if not _is_flip0(o) or len(o.users) != 1 or outs.count(o) != 1 or o.name not in places:
            continue
        ph = places[o.name]
        last = [n for n in bw.graph.nodes if n.op == "placeholder"][-1]
        with bw.graph.inserting_after(last):
            flipped = bw.graph.call_function(_flip, (ph, [0]))
        flipped.meta = dict(ph.meta)
        ph.replace_all_uses_with(flipped, delete_user_cb=lambda user: user is not flipped)
        outs[i] = o.args[0]
        changed = True
    if not changed:
        return
    out.args = (type(out.args[0])(outs),)
    for n in list(fw.graph.nodes):
        if _is_flip0(n) and not n.users:
            fw.graph.erase_node(n)
    fw.recompile()
    bw.recompile()
