"""gallery/llama --packing: a row of packed sequences computes what each sequence computes
alone (loss and gradients), plain and --kernel-opt, eagerly and on the torchacc device, with and
without scan_layers; PackedMockTokens' rows; the launcher trains on them like eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gallery_harness import load_metrics, run_launcher

import torchacc
from gallery.gpt.data import PackedMockTokens
from gallery.llama.model import build_llama

DEV = torchacc.device()


def _row(lengths, vocab=512, seed=3):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    ids = torch.randint(0, vocab, (1, t), generator=g)
    targets = torch.randint(0, vocab, (1, t), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions, targets


def _loss_and_grads(model, device, pieces):
    """Sum over ``pieces`` of (ids, position_ids or None, targets) of the summed token loss."""
    model.zero_grad(set_to_none=True)
    total = 0
    for ids, positions, targets in pieces:
        args = (ids.to(device),) if positions is None else (ids.to(device), positions.to(device))
        logits = model(*args)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten(), reduction="sum")
        loss.backward()
        total = total + loss.detach()
    if device == DEV:
        torchacc.sync()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    return total.cpu(), grads


def _build(kernels, scan_layers=False):
    torch.manual_seed(0)
    return build_llama("llama-tiny", kernels=kernels, scan_layers=scan_layers)


@pytest.mark.parametrize(
    "kernels, device, scan",
    [(False, "cpu", False), (True, "cpu", False), (False, "dev", False), (True, "dev", True)],
)
def test_packed_row_equals_each_sequence_alone(kernels, device, scan):
    device = DEV if device == "dev" else "cpu"
    lengths = [5, 9, 2, 16]
    ids, positions, targets = _row(lengths)
    model = _build(kernels, scan_layers=scan).to(device)
    packed = _loss_and_grads(model, device, [(ids, positions, targets)])
    pieces, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        pieces.append((ids[:, sl], None, targets[:, sl]))
        start += n
    alone = _loss_and_grads(model, device, pieces)
    torch.testing.assert_close(packed[0], alone[0], rtol=1e-5, atol=1e-5)
    for name, grad in alone[1].items():
        torch.testing.assert_close(packed[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    # and packing matters: without position ids the same row computes something else
    unpacked = _loss_and_grads(model, device, [(ids, None, targets)])
    name = "layers.0.attn.q_proj.weight" if not scan else next(iter(alone[1]))
    assert not torch.allclose(unpacked[1][name], alone[1][name], rtol=1e-2, atol=1e-4)


def test_position_ids_of_another_shape_are_named():
    model = _build(False)
    ids, positions, _ = _row([4, 4])
    with pytest.raises(ValueError, match=r"position_ids \(1, 7\).*\(1, 8\)"):
        model(ids, positions[:, :7])


def test_packed_mock_tokens_rows():
    data = PackedMockTokens(512, 32, min_len=3, max_len=12, num_samples=64, seed=5)
    (ids, positions), targets = data.get_batch(torch.tensor([0, 7, 7]))
    assert ids.shape == positions.shape == targets.shape == (3, 32)
    assert torch.equal(ids[1], ids[2]) and not torch.equal(ids[0], ids[1])  # by index, reproducible
    for row, index in zip(positions, [0, 7]):
        lengths = data.lengths(index)
        assert sum(lengths) == 32 and all(n <= 12 for n in lengths)
        assert all(n >= 3 for n in lengths[:-1])  # only the last one is cut to fit
        assert torch.equal(row, torch.cat([torch.arange(n) for n in lengths]))
    # each sequence is a corpus window: its targets are its inputs shifted by one
    first = data.lengths(0)[0]
    assert torch.equal(ids[0, 1:first], targets[0, : first - 1])
    with pytest.raises(ValueError, match="min_len"):
        PackedMockTokens(512, 32, min_len=20, max_len=12)


def test_launcher_packing_compiler_matches_eager(tmp_path):
    """``--packing`` through the launcher: --compiler-opt's losses equal eager's."""
    common = ["--model=llama-tiny", "--packing", "--seq_len=32", "--batch_size=2", "--max_steps=3"]
    common += ["--log_interval=1", "--amp_level=O0", "--kernel-opt"]
    eager, acc = tmp_path / "eager.json", tmp_path / "acc.json"
    p = run_launcher(*common, f"--output={eager}", timeout=300)
    assert "packed rows" in p.stdout
    run_launcher(*common, "--compiler-opt", f"--output={acc}", timeout=540)
    e, a = load_metrics(eager)["losses"], load_metrics(acc)["losses"]
    assert len(e) == len(a) == 3
    for i, (x, y) in enumerate(zip(a, e)):
        assert abs(x - y) <= 1e-4 * abs(y), (i, a, e)
    assert a[0] != a[1]  # it trained
