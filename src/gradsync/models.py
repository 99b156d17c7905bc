"""Small models for tests and benchmarks, and real gradients taken from them.

``build(name, seed=0)`` builds a model with a fixed seed (never the global RNG state of the
caller: initialisation runs under ``torch.random.fork_rng``). ``real_gradients(...)`` trains a
model a few SGD steps on real Fashion-MNIST and returns its per-parameter gradients (and, with
``accumulate=True``, the sum over steps as error feedback would accumulate it): the "real
model's gradient" that sparsifier and format tests and benchmarks measure on.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["CNN", "MLP", "ResNet18", "TinyGPT", "build", "names", "real_gradients"]


class CNN(nn.Module):
    """LeNet-style CNN for 28×28 grey images (≈ 0.4 M parameters)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    def __init__(self, inp: int = 784, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(inp, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """Pre-norm transformer block: attention (qkv + output projection) and a 4× MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.attn_qkv = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn_qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(nn.functional.gelu(self.mlp_fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-like decoder: token + position embeddings, ``layers`` blocks, LM head."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4,
                 context: int = 32) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 (He et al.), CIFAR-style stem for small grey images (11.2 M parameters)."""

    def __init__(self, classes: int = 10, channels: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, 64, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


_BUILDERS = {"cnn": CNN, "mlp": MLP, "gpt_tiny": TinyGPT, "resnet18": ResNet18}


def names() -> list[str]:
    return sorted(_BUILDERS)


def build(name: str, seed: int = 0, **kwargs) -> nn.Module:
    """Build model ``name`` deterministically from ``seed`` (global RNG left untouched)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(names())}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _BUILDERS[name](**kwargs)


def real_gradients(
    model: str = "cnn", steps: int = 5, batch_size: int = 64, lr: float = 0.05, seed: int = 0,
    accumulate: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-parameter gradients of ``model`` after ``steps`` SGD steps on real data.

    ``cnn``/``mlp``/``resnet18`` train on Fashion-MNIST (raises ``DatasetUnavailable`` when it
    is not installed); ``gpt_tiny`` trains on the bytes of this package's own source text. With
    ``accumulate=True`` the gradients of all steps are summed (what a residual accumulates
    when nothing is sent), which is the input DenseStream Table I measures.
    """
    net = build(model, seed=seed)
    g = torch.Generator().manual_seed(seed)
    if model == "gpt_tiny":
        from pathlib import Path

        text = b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.rglob("*.py")))
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
        ctx = net.context

        def batch():
            starts = torch.randint(len(data) - ctx - 1, (batch_size,), generator=g)
            xb = torch.stack([data[s: s + ctx] for s in starts.tolist()])
            yb = torch.stack([data[s + 1: s + ctx + 1] for s in starts.tolist()])
            return xb, yb

        def loss_fn(out, y):
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    else:
        from gradsync.data import fashion_mnist

        x, y = fashion_mnist(train=True, limit=batch_size * max(steps, 1) * 4)

        def batch():
            i = torch.randint(len(x), (batch_size,), generator=g)
            return x[i], y[i]

        loss_fn = nn.functional.cross_entropy
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    total = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    for _ in range(max(1, steps)):
        xb, yb = batch()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(xb), yb)
        if not math.isfinite(loss.detach().item()):
            raise RuntimeError(f"{model}: non-finite loss while sampling gradients")
        loss.backward()
        for n, p in net.named_parameters():
            total[n] += p.grad
        opt.step()
    if accumulate:
        return total
    return {n: p.grad.detach().clone() for n, p in net.named_parameters()}
