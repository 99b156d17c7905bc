"""Datasets available offline: real Fashion-MNIST and a real English text corpus, from Debian.

``fashion_mnist(train=True)`` reads the IDX files under ``/usr/share/datasets/fashion-mnist``
(Debian's ``dataset-fashion-mnist``, installed by ``make install`` when root).

``text_corpus()`` is the text the language models train on: the fortune-cookie collection of
Debian's ``fortunes`` package (``/usr/share/games/fortunes``, about 2.5 MB of English prose,
quotations, poems and song lyrics; ``apt-get install fortunes``, which ``make install`` does as
root). The ``%`` separators are dropped, the ``art``/``ascii-art`` files are left out, the
files are read in sorted order, so the text is the same on every machine with the package.
``ByteTokenizer`` (256 byte ids + a mask id) and ``WordTokenizer`` (a word-level vocabulary
built from the corpus, PTB-style ``<unk>``/``<eos>``) turn it into ids; ``lm_batches`` cuts
seeded causal-LM (next-token targets) or masked-LM (BERT's 15 %, 80/10/10) batches from them.

When data is missing these raise :class:`DatasetUnavailable` with the install command; callers
that accept a stand-in say so explicitly (``synthetic_images``; ``text_corpus(fallback=True)``
returns this package's own source text) — nothing silently swaps real data for something else.
"""

from __future__ import annotations

import functools
import gzip
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "FASHION_MNIST_DIR", "TEXT_CORPUS_DIR", "ByteTokenizer", "DatasetUnavailable",
    "WordTokenizer", "corpus_tokens", "fashion_mnist", "lm_batches", "synthetic_images",
    "text_corpus", "word_tokenizer",
]

FASHION_MNIST_DIR = Path(os.environ.get("GRADSYNC_FASHION_MNIST",
                                        "/usr/share/datasets/fashion-mnist"))
TEXT_CORPUS_DIR = Path(os.environ.get("GRADSYNC_TEXT_CORPUS", "/usr/share/games/fortunes"))
_SKIP_FILES = {"art", "ascii-art"}  # drawings, not text


class DatasetUnavailable(FileNotFoundError):
    pass


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file")
    dtype_code, ndim = data[2], data[3]
    if dtype_code != 0x08:
        raise ValueError(f"{path}: expected unsigned bytes, got type code {dtype_code:#x}")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    count = int(np.prod(dims))
    if len(data) - offset != count:
        raise ValueError(f"{path}: expected {count} bytes of data, found {len(data) - offset}")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims)


def fashion_mnist(
    train: bool = True, limit: int | None = None, root: Path | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 1, 28, 28)`` float32 normalised to mean 0 / std 1, labels ``(N,)`` int64."""
    root = Path(root) if root is not None else FASHION_MNIST_DIR
    prefix = "train" if train else "t10k"
    img_path = root / f"{prefix}-images-idx3-ubyte.gz"
    lbl_path = root / f"{prefix}-labels-idx1-ubyte.gz"
    if not img_path.exists() or not lbl_path.exists():
        raise DatasetUnavailable(
            f"Fashion-MNIST not found under {root}; install it with "
            "`apt-get install dataset-fashion-mnist` (make install does this as root)"
        )
    images = torch.from_numpy(_read_idx(img_path).copy())
    labels = torch.from_numpy(_read_idx(lbl_path).copy()).to(torch.int64)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    x = images.to(torch.float32).div_(255.0).sub_(0.2860).div_(0.3530).unsqueeze(1)
    return x, labels


def synthetic_images(
    n: int, seed: int = 0, classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic stand-in with Fashion-MNIST's shapes (explicit opt-in only)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(classes, (n,), generator=g)


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------
def _corpus_files(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in sorted(root.iterdir())
            if p.is_file() and not p.suffix and p.name not in _SKIP_FILES]


def _source_text() -> str:
    here = Path(__file__).parent
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(here.rglob("*.py")))


@functools.lru_cache(maxsize=4)
def _read_corpus(root: str) -> str:
    parts = []
    for p in _corpus_files(Path(root)):
        raw = p.read_bytes().decode("utf-8", errors="replace")
        entries = (e.strip("\n") for e in re.split(r"^%\s*$", raw, flags=re.M))
        parts.extend(e for e in entries if e.strip())
    return "\n\n".join(parts) + "\n"


def text_corpus(root: Path | str | None = None, *, fallback: bool = False,
                limit: int | None = None) -> str:
    """The offline English corpus as one string (see the module docstring).

    Raises :class:`DatasetUnavailable` when it is not installed, unless ``fallback=True``: then
    this package's own Python source is returned instead (explicitly asked for, never silent).
    ``limit`` keeps the first ``limit`` characters.
    """
    root = Path(root) if root is not None else TEXT_CORPUS_DIR
    if _corpus_files(root):
        text = _read_corpus(str(root))
    elif fallback:
        text = _source_text()
    else:
        raise DatasetUnavailable(
            f"text corpus not found under {root}; install it with `apt-get install fortunes` "
            "(make install does this as root), point GRADSYNC_TEXT_CORPUS at a folder of text "
            "files, or pass fallback=True to train on this package's source text"
        )
    return text[:limit] if limit is not None else text


class ByteTokenizer:
    """Byte-level ids: UTF-8 bytes 0..255, plus ``mask_id`` = 256 (for masked LMs).

    ``vocab_size`` = 257; ``regular_size`` = 256 (the ids a random replacement may draw)."""

    vocab_size = 257
    regular_size = 256
    mask_id = 256

    def encode(self, text: str) -> torch.Tensor:
        data = bytearray(text.encode("utf-8"))
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64) if data else \
            torch.zeros(0, dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        ids = torch.as_tensor(ids).reshape(-1)
        ids = ids[(ids >= 0) & (ids < 256)]
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")


class WordTokenizer:
    """Word-level vocabulary built from a text (PTB-style): lower-cased words and punctuation,
    the ``max_vocab`` − 3 most frequent kept (ties broken alphabetically), others ``<unk>``;
    a newline is ``<eos>``; ``<mask>`` for masked LMs. ids: 0 ``<unk>``, 1 ``<eos>``,
    2 ``<mask>``, then words by decreasing frequency."""

    SPECIALS = ("<unk>", "<eos>", "<mask>")

    def __init__(self, words: list[str]) -> None:
        self.itos = list(self.SPECIALS) + [w for w in words if w not in self.SPECIALS]
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.vocab_size = self.regular_size = len(self.itos)
        self.unk_id, self.eos_id, self.mask_id = 0, 1, 2

    @classmethod
    def build(cls, text: str, max_vocab: int = 10_000) -> WordTokenizer:
        if max_vocab < len(cls.SPECIALS) + 1:
            raise ValueError(f"max_vocab must be >= {len(cls.SPECIALS) + 1}, got {max_vocab}")
        counts = Counter(_WORD.findall(text.lower()))
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls([w for w, _ in ranked[: max_vocab - len(cls.SPECIALS)]])

    def tokens(self, text: str) -> list[str]:
        out: list[str] = []
        for line in text.lower().split("\n"):
            out.extend(_WORD.findall(line))
            out.append("<eos>")
        return out[:-1] if not text.endswith("\n") and out else out

    def encode(self, text: str) -> torch.Tensor:
        get, unk = self.stoi.get, self.unk_id
        return torch.tensor([get(w, unk) for w in self.tokens(text)], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        words = [self.itos[i] for i in torch.as_tensor(ids).reshape(-1).tolist()]
        return " ".join(words).replace(" <eos> ", "\n").replace("<eos>", "\n")


@functools.lru_cache(maxsize=4)
def word_tokenizer(max_vocab: int = 10_000, fallback: bool = False) -> WordTokenizer:
    """The corpus's word vocabulary (cached)."""
    return WordTokenizer.build(text_corpus(fallback=fallback), max_vocab)


_TOKENS: dict[tuple, tuple[object, torch.Tensor]] = {}


def corpus_tokens(tokenizer: ByteTokenizer | WordTokenizer, *, fallback: bool = False,
                  limit: int | None = None) -> torch.Tensor:
    """The corpus encoded by ``tokenizer`` as one int64 tensor (cached per tokenizer; the
    cache holds the tokenizer too, so its ``id`` cannot be reused by another one)."""
    who = "bytes" if isinstance(tokenizer, ByteTokenizer) else id(tokenizer)
    key = (who, fallback, limit, str(TEXT_CORPUS_DIR))
    if key not in _TOKENS:
        if len(_TOKENS) >= 8:
            _TOKENS.clear()
        _TOKENS[key] = (tokenizer, tokenizer.encode(text_corpus(fallback=fallback, limit=limit)))
    return _TOKENS[key][1]


def lm_batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, *, kind: str = "causal",
    seed: int = 0, mask_id: int | None = None, random_high: int | None = None,
    mask_prob: float = 0.15, steps: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded ``(inputs, targets)`` batches of ``(batch_size, seq_len)`` int64 ids.

    ``kind="causal"``: windows at random offsets, targets = the next token. ``kind="masked"``
    (BERT): each position is chosen with probability ``mask_prob`` (at least one per row);
    chosen inputs become ``mask_id`` (80 %), a random id below ``random_high`` (10 %) or stay
    (10 %); targets are the original ids at chosen positions and −100 elsewhere. Endless unless
    ``steps`` is given. Randomness only from a ``torch.Generator`` seeded with ``seed``.
    """
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 1 or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be a 1-D int64 tensor, got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if kind not in ("causal", "masked"):
        raise ValueError(f"kind must be 'causal' or 'masked', got {kind!r}")
    if tokens.numel() < seq_len + 2:
        raise ValueError(f"{tokens.numel()} tokens are too few for seq_len={seq_len}")
    if kind == "masked":
        if mask_id is None or random_high is None or random_high < 1:
            raise ValueError("masked batches need mask_id and random_high >= 1")
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len)
    done = 0
    while steps is None or done < steps:
        done += 1
        starts = torch.randint(tokens.numel() - seq_len - 1, (batch_size, 1), generator=g)
        idx = starts + offsets
        x = tokens[idx]
        if kind == "causal":
            yield x, tokens[idx + 1]
            continue
        chosen = torch.rand(x.shape, generator=g) < mask_prob
        force = torch.randint(seq_len, (batch_size,), generator=g)
        chosen[torch.arange(batch_size), force] = True
        y = torch.where(chosen, x, torch.full_like(x, -100))
        r = torch.rand(x.shape, generator=g)
        rand_ids = torch.randint(random_high, x.shape, generator=g)
        x = torch.where(chosen & (r < 0.8), torch.full_like(x, mask_id), x)
        x = torch.where(chosen & (r >= 0.8) & (r < 0.9), rand_ids, x)
        yield x, y
