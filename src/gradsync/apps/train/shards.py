"""One rank's data: its disjoint shard of the training set, the test set, and which data is
installed (:func:`resolve_data`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from gradsync.apps.train.spec import TrainSpec

__all__ = ["RankData", "load_images", "resolve_data"]


class RankData:
    """One rank's shard of the training data and the evaluation set (seeded, disjoint).

    Images: a seeded permutation of the training set, rank r takes every P-th image from r;
    each epoch visits the shard in a new seeded order. Text: the first 90 % of the corpus
    tokens cut into P contiguous, disjoint regions; batches are seeded random windows of a
    rank's region (``gradsync.apps.data.lm_batches``: causal or masked targets); the last 10 % is
    the evaluation text.
    """

    def __init__(self, kind: str, task: str, rank: int, P: int, batch: int, seed: int,
                 device: torch.device, model_name: str = "", model: nn.Module | None = None,
                 text_fallback: bool = False) -> None:
        self.kind, self.task, self.rank, self.P, self.batch = kind, task, rank, P, batch
        self.seed, self.device = seed, device
        self._epoch, self._order, self._pos = -1, None, 0
        if task == "image":
            x, y, self.test_x, self.test_y = load_images(kind, seed)
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
            mine = perm[rank::P]  # disjoint by rank, same permutation everywhere
            self.x, self.y = x[mine], y[mine]
            self.shard_len = len(mine)
            return
        from gradsync.apps import data

        tok = (data.word_tokenizer(max_vocab=getattr(model, "vocab", 10_000),
                                   fallback=text_fallback)
               if model_name == "lstm" else data.ByteTokenizer())
        if kind == "text":
            tokens = data.corpus_tokens(tok, fallback=text_fallback)
        else:
            tokens = torch.randint(tok.regular_size, (400_000,),
                                   generator=torch.Generator().manual_seed(seed))
        self.T = int(min(getattr(model, "context", None) or 128, 128))
        split = int(len(tokens) * 0.9)
        train, self.test = tokens[:split], tokens[split:]
        per = len(train) // P
        self.train = train[rank * per:(rank + 1) * per]
        if len(self.train) < self.T + 2 or len(self.test) < self.T + 2:
            raise ValueError(f"text too small for {P} ranks at sequence length {self.T}")
        self.shard_len = len(self.train) // self.T
        self._lm_kw = {"kind": "masked" if task == "masked_lm" else "causal",
                       "mask_id": tok.mask_id, "random_high": tok.regular_size}
        self._stream = data.lm_batches(self.train, batch, self.T, seed=self._seed(0),
                                       **self._lm_kw)

    def steps_per_epoch(self) -> int:
        """Batches in one pass over this rank's shard (at least 1)."""
        return max(1, self.shard_len // self.batch)

    def _seed(self, epoch: int) -> int:
        return (self.seed * 1_000_003 + self.rank) * 7919 + epoch

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next training batch ``(inputs, targets)`` on ``device``."""
        if self.task != "image":
            xb, yb = next(self._stream)
            return xb.to(self.device), yb.to(self.device)
        if self._order is None or self._pos + self.batch > len(self._order):
            self._epoch += 1
            g = torch.Generator().manual_seed(self._seed(self._epoch))
            self._order = torch.randperm(self.shard_len, generator=g)
            self._pos = 0
        i = self._order[self._pos:self._pos + self.batch]
        self._pos += self.batch
        return self.x[i].to(self.device), self.y[i].to(self.device)

    def eval_batches(self, n: int):
        """The first ``n`` test batches (images) or ``n`` seeded windows of the test text."""
        if n <= 0:
            return
        if self.task != "image":
            from gradsync.apps import data

            for xb, yb in data.lm_batches(self.test, self.batch, self.T, seed=self.seed + 12345,
                                          steps=n, **self._lm_kw):
                yield xb.to(self.device), yb.to(self.device)
            return
        for b in range(n):
            lo = b * self.batch
            if lo >= len(self.test_x):
                return
            yield (self.test_x[lo:lo + self.batch].to(self.device),
                   self.test_y[lo:lo + self.batch].to(self.device))


_CACHE: dict[tuple, Any] = {}  # per process: the data is read once for all schemes


def load_images(kind: str, seed: int) -> tuple[torch.Tensor, ...]:
    """``(train_x, train_y, test_x, test_y)`` of ``fashion-mnist`` or seeded ``synthetic``
    images, read once per process (every scheme of a job trains on the same data)."""
    key = ("images", kind, seed)
    if key not in _CACHE:
        if kind == "fashion-mnist":
            from gradsync.apps.data import fashion_mnist

            _CACHE[key] = (*fashion_mnist(train=True), *fashion_mnist(train=False))
        else:
            from gradsync.apps.data import synthetic_images

            _CACHE[key] = (*synthetic_images(8192, seed=seed),
                           *synthetic_images(2048, seed=seed + 1))
    return _CACHE[key]




def resolve_data(spec: TrainSpec, quiet: bool = False) -> TrainSpec:
    """``spec`` with the data that will really be used: the real data set by default; a
    stand-in only by choice or, with a one-line note (unless ``quiet``), when it is not
    installed (synthetic images for ``fashion-mnist``, gradsync's own source text for ``text``).
    """
    from gradsync.apps.data import DatasetUnavailable, fashion_mnist, text_corpus

    if spec.data == "text":
        try:
            text_corpus(limit=1)
        except DatasetUnavailable as e:
            if not quiet:
                print(f"note: {e}; training on gradsync's own SOURCE TEXT instead")
            return dataclasses.replace(spec, text_fallback=True)
        return spec
    if spec.data != "fashion-mnist":
        return spec
    try:
        fashion_mnist(train=False, limit=1)
    except DatasetUnavailable as e:
        if not quiet:
            print(f"note: {e}; training on SYNTHETIC images instead (accuracy is "
                  "meaningless)")
        return dataclasses.replace(spec, data="synthetic")
    return spec
