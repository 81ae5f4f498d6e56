"""Mock token data for the GPT gallery model.

A deterministic corpus (from the seed) of phrases drawn with Zipf-like frequencies from a
phrase table, so a model can learn something (unigram statistics, then phrases) and the loss
goes down. Sample ``i`` is the window of ``seq_len + 1`` tokens at a fixed pseudo-random
offset; inputs are its first ``seq_len`` tokens, targets the last ``seq_len``.

``PackedMockTokens``: padding-free packed rows for SFT-style training. Each row is several
windows of random lengths laid end to end (each window its own sequence with its own next-token
targets), with ``position_ids`` restarting at 0 where a window starts; inputs are
``(token_ids, position_ids)``.

Both are functions of (seed, index): their ``state_dict()`` is what identifies them (kind, length,
seed, row shape) and ``load_state_dict`` checks a saved one against this dataset, so a resumed run
cannot silently continue on other data (Note [Data positions] in
torchacc/distributed/data_state.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from gallery.common.launchlib import torchacc_data_state

_data_state = torchacc_data_state()  # by file: the eager path must not import torchacc
STATE_VERSION = _data_state.STATE_VERSION
check_state = _data_state.check_state

__all__ = ["MockTokens", "PackedMockTokens"]


class MockTokens(Dataset):
    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        num_samples: int = 1 << 20,
        seed: int = 0,
        corpus_tokens: int = 1 << 20,
    ):
        self.seq_len = seq_len
        self.num_samples = num_samples
        self.seed = seed
        self.vocab_size = vocab_size
        rng = np.random.default_rng([seed, 7])
        n_phrases = 4096
        lengths = rng.integers(2, 17, n_phrases)
        ranks = np.arange(1, vocab_size + 1, dtype=np.float64)
        probs = 1.0 / ranks**1.1
        probs /= probs.sum()
        table = rng.choice(vocab_size, size=int(lengths.sum()), p=probs)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        corpus_tokens = max(corpus_tokens, 4 * (seq_len + 1))
        phrase_p = 1.0 / np.arange(1, n_phrases + 1) ** 0.8
        phrase_p /= phrase_p.sum()
        picks = rng.choice(n_phrases, size=corpus_tokens // 4 + 1, p=phrase_p)
        pieces = [table[starts[k] : starts[k] + lengths[k]] for k in picks]
        corpus = np.concatenate(pieces)
        while len(corpus) < corpus_tokens:  # pragma: no cover - phrases average 9 tokens
            corpus = np.concatenate([corpus, corpus])
        self.corpus = torch.from_numpy(corpus[:corpus_tokens].astype(np.int64))
        self.span = len(self.corpus) - (seq_len + 1) + 1
        self.arange = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return self.num_samples

    def _identity(self) -> dict:
        return {
            "dataset_len": self.num_samples,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "vocab_size": self.vocab_size,
        }

    def state_dict(self) -> dict:
        """What identifies this dataset (its rows are functions of seed and index)."""
        return {"kind": type(self).__name__, "version": STATE_VERSION, **self._identity()}

    def load_state_dict(self, state: dict, source=None) -> None:
        """Check that ``state`` was saved from this dataset (a ``DataStateError`` if not)."""
        check_state(state, type(self).__name__, self._identity(), source)

    def _offsets(self, indices: torch.Tensor) -> torch.Tensor:
        return (indices * 2_654_435_761 + 12_345) % self.span

    def get_batch(self, indices: torch.Tensor):
        windows = self.corpus[self._offsets(indices)[:, None] + self.arange]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __getitem__(self, index: int):
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]


class PackedMockTokens(MockTokens):
    """Rows of ``seq_len`` tokens packing windows of ``min_len``..``max_len`` tokens (the last
    window of a row is cut to fit). ``get_batch`` -> ``((ids, position_ids), targets)``; a row's
    windows are drawn from the seed and the row's index, so any worker sees the same rows."""

    def __init__(self, vocab_size, seq_len, min_len=4, max_len=None, **kwargs):
        super().__init__(vocab_size, seq_len, **kwargs)
        self.min_len, self.max_len = min_len, max_len or seq_len
        if not 1 <= self.min_len <= self.max_len <= seq_len:
            raise ValueError(
                f"PackedMockTokens: need 1 <= min_len <= max_len <= seq_len, got {min_len}, "
                f"{max_len}, {seq_len}"
            )
        self._seed = kwargs.get("seed", 0)

    def _identity(self) -> dict:
        return {**super()._identity(), "min_len": self.min_len, "max_len": self.max_len}

    def lengths(self, index: int) -> list[int]:
        """The lengths of row ``index``'s sequences (they sum to ``seq_len``)."""
        rng = np.random.default_rng([self._seed, 11, int(index)])
        out, left = [], self.seq_len
        while left:
            n = min(int(rng.integers(self.min_len, self.max_len + 1)), left)
            out.append(n)
            left -= n
        return out

    def get_batch(self, indices: torch.Tensor):
        ids, positions, targets = [], [], []
        for index in indices.tolist():
            lengths = self.lengths(index)
            offsets = self._offsets(torch.arange(len(lengths)) + index * self.seq_len)
            row = [self.corpus[o : o + n + 1] for o, n in zip(offsets.tolist(), lengths)]
            ids.append(torch.cat([w[:-1] for w in row]))
            targets.append(torch.cat([w[1:] for w in row]))
            positions.append(torch.cat([torch.arange(n) for n in lengths]))
        return (torch.stack(ids), torch.stack(positions)), torch.stack(targets)

    def __getitem__(self, index: int):
        (x, p), y = self.get_batch(torch.tensor([index]))
        return (x[0], p[0]), y[0]
