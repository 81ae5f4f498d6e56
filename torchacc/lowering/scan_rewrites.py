"""Graph rewrites of torch's scan autograd (the trace-once frontend's ``higher_order.scan``) before
torchacc lowers it: the backward scan reads the forward's stacks in reverse instead of through
``flip`` copies, and reads the layers' own stacked weights instead of per-step copies of them.

Note [Copy-free backward scans]
torch's scan autograd (torch/_higher_order_ops/scan.py, 2.13) differentiates ``scan(fn)`` into a
forward scan that also stacks the per-step values the backward needs, and a backward that is a
forward ``scan_op`` over ``flip(x, [0])`` of every stacked input, flipping every stacked gradient
it returns. Lowered as written, two kinds of whole-stack copies made the steady step slower than
the unrolled loop (gallery GPT, depth 8, n_embd 128: measured in benchmarks/RESULTS.md, Issue 32):

1. ``aten.flip`` copies the whole stack, and XLA does not fold it into the while loop's per-step
   slices. ``lax.scan(reverse=True)`` reads step ``i`` at index ``n - 1 - i`` and stacks its
   outputs there, i.e. it is ``flip(scan(flip(xs)).ys)`` without the copies.
   ``reverse_flipped_scans`` replaces a scan whose xs are all ``flip(a, [0])`` by
   ``scan_reversed`` over the ``a``s; a stacked output read by ``flip(y, [0])`` feeds that
   reader's users directly (any other reader gets the flip back).
2. The partitioner inside the operator may save a per-step layout op of a stacked input (the
   transposed weight ``t(w)`` a linear layer's backward multiplies by) as a forward output, so the
   forward scan writes a transposed copy of every weight stack and the backward reads it back
   (40% of the saved bytes of a GPT block). ``sink_layouts`` makes the backward scan read the
   stacked input itself and apply the layout op inside its body (XLA folds a transpose into the
   dot); the forward's copy is then unused and JAX drops it from the loop.

compile_step traces one graph holding the forward scan, the flips and the backward scan:
``rewritten`` (run on every graph lower.py lowers) does both there. Under torch.compile AOTAutograd
splits that graph, and the forward graph's outputs saved for the backward graph carry the flips
and the copies across the boundary: ``rewrite_partition`` (dynamo/aot.py's partition) saves the
unflipped stack, or the stacked input a copy came from, instead, and starts the backward graph
with the flip / reads through the layout op (a saved value's backward placeholder is matched by
name: the partitioner names it after the forward node). The backward graph's scan is then
rewritten by ``rewritten`` like compile_step's.

No arithmetic changes (results are the same bits), the scan nodes and the number of compiled
programs stay the same. tests/test_scan_dynamo.py checks the lowered programs hold no reverse
(flip) and no transposed copy of a stacked array.
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx

from torchacc.lowering.fx_calling import HOP_RULES
from torchacc.lowering.scan import _hop_scan

aten = torch.ops.aten
_SCAN = torch.ops.higher_order.scan
_flip = aten.flip.default
# per-step ops that only move a stacked input's elements (sunk into the reading scan's body)
_LAYOUT = {
    aten.t_copy.default,
    aten.transpose_copy.int,
    aten.permute_copy.default,
    aten.view_copy.default,
    aten.clone.default,
    aten.detach_copy.default,
    aten.alias_copy.default,
    aten.unsqueeze_copy.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.view.default,
    aten.detach.default,
}


def scan_reversed(combine_fn, init, xs, additional_inputs):
    """``flip(scan_op(combine_fn, init, flip(xs)).ys)``, carries as they are, as one reverse
    ``lax.scan`` (Note [Copy-free backward scans])."""
    return _hop_scan(combine_fn, init, xs, additional_inputs, reverse=True)


HOP_RULES[scan_reversed] = scan_reversed


def _is_scan(node):
    return node.op == "call_function" and node.target in (_SCAN, scan_reversed)


def _is_flip0(node):
    """``aten.flip(x, [0])``: a reversal of the stacked (leading) dimension only."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is _flip):
        return False
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dims")
    val = node.meta.get("val")
    return val is not None and dims is not None and list(dims) in ([0], [-val.dim()])


def rewritten(gm):
    """``gm`` with both rewrites, as a new module sharing ``gm``'s submodules (a scan body the
    rewrite changes is copied first); ``gm`` itself when it holds no scan."""
    if not any(_is_scan(n) for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = fx.GraphModule(gm, graph)
    changed = reverse_flipped_scans(new.graph) > 0
    changed = sink_layouts(new) > 0 or changed
    if not changed:
        return gm
    new.graph.lint()
    new.recompile()
    return new


def reverse_flipped_scans(graph):
    """Rewrite ``graph``'s scans over flipped stacks into ``scan_reversed``; returns how many."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SCAN:
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


def _layout_of_xs(owner, scan, index):
    """If output ``index`` of ``scan`` (a stacked output) is per step only layout ops over one
    of its xs: (that xs node, the ops in order, the xs' per-step placeholder); else None."""
    combine, init, xs = owner.get_submodule(scan.args[0].target), scan.args[1], scan.args[2]
    out = next(n for n in reversed(combine.graph.nodes) if n.op == "output").args[0][index]
    chain = []
    while (
        isinstance(out, fx.Node)
        and out.op == "call_function"
        and out.target in _LAYOUT
        and not any(isinstance(a, fx.Node) for a in (*out.args[1:], *out.kwargs.values()))
    ):
        chain.append(out)
        out = out.args[0]
    if not chain or not isinstance(out, fx.Node) or out.op != "placeholder":
        return None
    places = [n for n in combine.graph.nodes if n.op == "placeholder"]
    j = places.index(out) - len(init)
    if not 0 <= j < len(xs):
        return None
    return xs[j], chain[::-1], out


def _read_through(owner, scan, pos, chain, slice_meta, bodies):
    """Make ``scan``'s body apply ``chain`` (nodes of another graph) to its xs ``pos`` slice,
    which now holds the stacked input the chain starts from (its per-step meta ``slice_meta``).
    The body is copied once per scan (``bodies``)."""
    if scan not in bodies:
        body = copy.deepcopy(owner.get_submodule(scan.args[0].target))
        name = f"{scan.args[0].target}_sunk"
        k = 0
        while hasattr(owner, f"{name}{k}"):
            k += 1
        owner.add_submodule(f"{name}{k}", body)
        with owner.graph.inserting_before(scan):
            attr = owner.graph.get_attr(f"{name}{k}")
        attr.meta = dict(scan.args[0].meta)
        scan.args = (attr, *scan.args[1:])
        bodies[scan] = body
    body = bodies[scan]
    places = [n for n in body.graph.nodes if n.op == "placeholder"]
    place = places[len(scan.args[1]) + pos]
    made = []
    for op in chain:
        with body.graph.inserting_after(made[-1] if made else places[-1]):
            prev = made[-1] if made else place
            made.append(body.graph.call_function(op.target, (prev, *op.args[1:]), dict(op.kwargs)))
        made[-1].meta = dict(op.meta)
    place.replace_all_uses_with(made[-1], delete_user_cb=lambda user: user is not made[0])
    place.meta = dict(slice_meta)
    body.graph.lint()
    body.recompile()


def sink_layouts(gm):
    """Scans of ``gm`` reading a stacked output of another scan that is a layout op of one of
    that scan's xs read those xs instead, the op applied in their body; returns how many."""
    graph, done, bodies = gm.graph, 0, {}
    for scan in [n for n in graph.nodes if _is_scan(n)]:
        for item in list(scan.users):
            if item.target is not operator.getitem or item.args[1] < len(scan.args[1]):
                continue
            found = _layout_of_xs(gm, scan, item.args[1])
            if found is None:
                continue
            source, chain, place = found
            for reader in list(item.users):
                if not _is_scan(reader) or item not in reader.args[2]:
                    continue
                xs = list(reader.args[2])
                for pos in [p for p, x in enumerate(xs) if x is item]:
                    _read_through(gm, reader, pos, chain, place.meta, bodies)
                    xs[pos] = source
                reader.args = (*reader.args[:2], xs, *reader.args[3:])
                done += 1
    return done


def rewrite_partition(fw, bw, num_fwd_outputs):
    """AOTAutograd's forward graph module ``fw`` saves for ``bw`` a flipped scan stack or a
    per-step layout copy of a scan's stacked input: save the stack (or the input) instead and
    start ``bw`` with the flip (or read through the layout op) (Note [Copy-free backward
    scans]). Both modules are changed in place."""
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = list(out.args[0])
    places = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    last = [n for n in bw.graph.nodes if n.op == "placeholder"][-1]
    changed, bodies = False, {}
    for i in range(num_fwd_outputs, len(outs)):
        o = outs[i]
        if not isinstance(o, fx.Node) or outs.count(o) != 1 or o.name not in places:
            continue
        ph = places[o.name]
        if _is_flip0(o) and len(o.users) == 1:
            with bw.graph.inserting_after(last):
                flipped = bw.graph.call_function(_flip, (ph, [0]))
            flipped.meta = dict(ph.meta)
            ph.replace_all_uses_with(flipped, delete_user_cb=lambda u, f=flipped: u is not f)
            outs[i] = o = o.args[0]
            changed = True
        if o.target is not operator.getitem or not _is_scan(o.args[0]):
            continue
        found = _layout_of_xs(fw, o.args[0], o.args[1])
        readers = _stack_readers(ph)
        if found is None or readers is None:
            continue
        source, chain, place = found
        for reader, pos in readers:
            _read_through(bw, reader, pos, chain, place.meta, bodies)
        for n in (ph, *[u for u in ph.users if _is_flip0(u)]):
            n.meta = dict(n.meta, val=source.meta["val"])
        outs[i] = source
        changed = True
    if not changed:
        return
    out.args = (type(out.args[0])(outs),)
    for n in reversed(list(fw.graph.nodes)):
        if n.op == "call_function" and not n.users and (_is_flip0(n) or _is_scan_item(n)):
            fw.graph.erase_node(n)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()


def _is_scan_item(node):
    return node.target is operator.getitem and _is_scan(node.args[0])


def _stack_readers(ph):
    """[(scan, xs position)] if every use of ``ph`` (directly or through one ``flip(ph, [0])``)
    is as a scan's xs; else None."""
    found = []
    for use in ph.users:
        targets = list(use.users) if _is_flip0(use) else [use]
        node = use if _is_flip0(use) else ph
        for t in targets:
            if not _is_scan(t) or any(node is a for a in (*t.args[1], *t.args[3])):
                return None
            found += [(t, p) for p, x in enumerate(t.args[2]) if x is node]
    return found or None
