"""Datasets available offline: real Fashion-MNIST from Debian's ``dataset-fashion-mnist``.

``fashion_mnist(train=True)`` reads the IDX files under ``/usr/share/datasets/fashion-mnist``
(installed by ``make install`` when root). When they are missing it raises
:class:`DatasetUnavailable` with the install command; callers that accept synthetic data say so
explicitly (``synthetic_images``) — nothing silently swaps real data for noise.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import torch

__all__ = ["FASHION_MNIST_DIR", "DatasetUnavailable", "fashion_mnist", "synthetic_images"]

FASHION_MNIST_DIR = Path(os.environ.get("GRADSYNC_FASHION_MNIST",
                                        "/usr/share/datasets/fashion-mnist"))


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
