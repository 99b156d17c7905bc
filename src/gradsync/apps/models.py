"""The model zoo: small models for tests, paper-scale definitions, and real gradients.

``build(name, seed=0)`` builds a model deterministically from ``seed`` (initialisation runs under
``torch.random.fork_rng``, so the caller's global RNG state is left untouched); ``device="meta"``
builds it without allocating memory (shapes only: the SSFusion census). ``names()`` lists every
model, ``task(name)`` says what data it eats, ``batches(name, batch_size)`` yields that data and
``loss(out, y)`` is the loss for all of them. ``real_gradients(...)`` trains a model a few SGD
steps on its real data and returns its per-parameter gradients: the "real model's gradient" that
sparsifier and format tests and benchmarks measure on.

Models and their data
=====================
================  ======================================================  ====================
name              definition                                              data
================  ======================================================  ====================
cnn, mlp          defined here (LeNet-style CNN, 3-layer MLP)             Fashion-MNIST
resnet18          defined here (He et al., CIFAR-style stem)              Fashion-MNIST
resnet20          defined here (He et al. §4.2 CIFAR net, option A)       Fashion-MNIST
resnet50/152      defined here (He et al., bottleneck, CIFAR-style stem)  Fashion-MNIST
vgg16/19          defined here (Simonyan & Zisserman D/E, no batch norm)  Fashion-MNIST
vit               defined here (Dosovitskiy et al.), ViT-Tiny dims        Fashion-MNIST
vit_large         defined here, ViT-L/16 layers (24 × 1024, 16 heads)     Fashion-MNIST
gpt_tiny          defined here (2-layer GPT, bytes)                       this package's source
gpt2_small        transformers ``GPT2LMHeadModel``, reduced config         text corpus, bytes
gpt2_large        ``GPT2LMHeadModel``, the real gpt2-large config (774 M)  text corpus, bytes
bert_small        transformers ``BertForMaskedLM``, reduced config        text corpus, bytes
bert_large        ``BertForMaskedLM``, the real bert-large config (335 M)  text corpus, bytes
lstm              defined here: word-level 2-layer LSTM LM (Zaremba)      text corpus, words
================  ======================================================  ====================

Fashion-MNIST adaptations (1 × 28 × 28 grey images, 10 classes), random init, no download:

* ResNet-50/152: the ImageNet stem (7×7 stride-2 conv + max-pool, for 224-pixel images) is
  replaced by a 3×3 stride-1 conv on 1 channel and no max-pool — the usual CIFAR stem, as in
  ``resnet18`` here. Every other layer is the published one.
* ResNet-20: the CIFAR network as published but for its first conv, on 1 channel; the 28 × 28
  images go in unpadded (stages at 28, 14, 7 instead of 32, 16, 8), as for ``resnet18``.
* VGG-16/19: the first conv takes 1 channel and the images are zero-padded to 32 × 32 so that
  the five 2×2 max-pools end at 1 × 1 (28 would end at 0); the published adaptive 7 × 7 pool and
  its 25088-4096-4096 classifier are kept (so the parameter count is the paper's, 134/139 M).
* ViT: image 28, patch 4 (7 × 7 = 49 patches + a class token), patch embedding on 1 channel.
* ``reference(name)`` gives the *unadapted* published definitions (ResNet-152 and ViT-L/16 at
  224 pixels and 1000 classes, bert-large, gpt2-large) for the SSFusion Table II census.

Language models: ``gpt2_*``/``bert_*``/``gpt_tiny`` read bytes (``data.ByteTokenizer``,
256 byte ids + a mask id 256); ``lstm`` reads words (``data.WordTokenizer`` built from
the corpus, its vocabulary size is the model's). GPT-2 is a causal LM (next-token targets),
BERT a masked LM (15 % of positions; 80/10/10 mask/random/keep; other targets −100).

ResNet, VGG and ViT are this module's own definitions (:class:`ResNet`, :class:`VGG`,
:class:`ViT`): their module and parameter names, shapes and order are those of the common
published definitions (torchvision's), so parameter counts and per-tensor tables match them;
torchvision is neither needed nor imported. transformers is optional
(``pip install 'gradsync[models]'``; ``make install`` installs it).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "CNN", "LSTMLM", "MLP", "VGG", "ResNet", "ResNet18", "ResNet20", "TinyGPT", "ViT",
    "ZeroPadShortcut", "batches", "build", "gradient_steps", "hf_classes", "import_transformers",
    "loss", "names", "real_gradients", "reference", "requires", "task",
]

INSTALL_HINT = "pip install 'gradsync[models]' (make install does this)"


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


class LSTMLM(nn.Module):
    """Word-level LSTM language model (Zaremba et al. 2014, "small": 2 × 200, PTB-style).

    Embedding → ``layers``-layer LSTM → dropout → linear decoder over the vocabulary; the
    decoder weight is tied to the embedding when ``tie`` (Press & Wolf). ``forward(ids)`` takes
    ``(batch, time)`` word ids and returns ``(batch, time, vocab)`` logits.
    """

    def __init__(self, vocab: int = 10_000, dim: int = 200, layers: int = 2,
                 dropout: float = 0.0, tie: bool = True, context: int = 35) -> None:
        super().__init__()
        self.vocab, self.context = vocab, context
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, num_layers=layers, batch_first=True,
                           dropout=dropout if layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(dim, vocab)
        if tie:
            self.decoder.weight = self.embed.weight
        for w in (self.embed.weight, self.decoder.weight):
            nn.init.uniform_(w, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.drop(self.embed(ids)))
        return self.decoder(self.drop(y))


class HFLogits(nn.Module):
    """A transformers model as ``model(ids) -> logits`` (the zoo's one calling convention)."""

    def __init__(self, hf: nn.Module, context: int) -> None:
        super().__init__()
        self.hf = hf
        self.context = context
        self.config = hf.config

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=ids).logits


class PadTo(nn.Module):
    """Zero-pad images symmetrically to ``size`` × ``size`` (VGG: 28 → 32)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        ph, pw = max(0, self.size - h), max(0, self.size - w)
        return nn.functional.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))


# ---------------------------------------------------------------------------------------------
# Vision models at paper scale: ResNet (bottleneck), VGG, ViT
# ---------------------------------------------------------------------------------------------
# Written for this package from the papers; module and parameter names, shapes and order are those
# of the common published definitions, so checkpoints and per-tensor tables line up with theirs.
class Bottleneck(nn.Module):
    """ResNet bottleneck block (He et al. 2016, §3.3 "Deeper Bottleneck Architectures").

    1×1 reduce → 3×3 → 1×1 expand (``expansion`` = 4), batch norm after each conv, a projection
    shortcut (1×1 conv + BN) when the shape changes. The stride sits on the 3×3 conv ("v1.5").
    """

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


def _he_init(model: nn.Module) -> None:
    """He et al.'s initialisation of a ResNet: convs He-normal (fan-out), batch norm 1 and 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class ZeroPadShortcut(nn.Module):
    """He et al. 2016's shortcut option A: the identity, subsampled by ``stride`` and with
    ``cout − cin`` zero channels added (half before, half after): no parameters."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        if cout < cin:
            raise ValueError(f"option A cannot reduce channels ({cin} -> {cout})")
        self.stride, self.front = stride, (cout - cin) // 2
        self.back = cout - cin - self.front

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, ::self.stride, ::self.stride]
        return nn.functional.pad(x, (0, 0, 0, 0, self.front, self.back))


class BuildingBlock(nn.Module):
    """ResNet building block (He et al. 2016, Fig. 5 left: two 3×3 convs; ResNet-18/34/20).

    When the shape changes the shortcut is ``shortcut="B"`` (a projection: 1×1 conv + BN, the
    ImageNet ResNets) or ``"A"`` (:class:`ZeroPadShortcut`, parameter-free: the CIFAR ResNets).
    """

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1, shortcut: str = "B") -> None:
        super().__init__()
        if shortcut not in ("A", "B"):
            raise ValueError(f"shortcut must be 'A' or 'B', got {shortcut!r}")
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample: nn.Module | None = None
        if (stride != 1 or cin != width) and shortcut == "A":
            self.downsample = ZeroPadShortcut(cin, width, stride)
        elif stride != 1 or cin != width:
            self.downsample = nn.Sequential(nn.Conv2d(cin, width, 1, stride, bias=False),
                                            nn.BatchNorm2d(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


RESNET_STAGES = {18: (BuildingBlock, (2, 2, 2, 2)), 50: (Bottleneck, (3, 4, 6, 3)),
                 152: (Bottleneck, (3, 8, 36, 3))}  # He et al. 2016, Table 1


class ResNet(nn.Module):
    """ResNet-18/50/152 (He et al. 2016, Table 1).

    ``stem="imagenet"``: 7×7 stride-2 conv and 3×3 stride-2 max-pool (224-pixel images);
    ``stem="small"``: 3×3 stride-1 conv and no pooling (28/32-pixel images). Four stages of
    64/128/256/512-wide blocks (stages 2–4 halve the resolution), global average pool, linear.
    Initialisation: convs He-normal (fan-out), batch norm weight 1 and bias 0, the classifier
    PyTorch's default.
    """

    def __init__(self, depth: int = 50, classes: int = 1000, channels: int = 3,
                 stem: str = "imagenet", base_width: int = 64) -> None:
        super().__init__()
        if base_width < 1:
            raise ValueError(f"base_width must be >= 1, got {base_width}")
        if depth not in RESNET_STAGES:
            raise ValueError(f"ResNet depth must be one of {sorted(RESNET_STAGES)}, got {depth}")
        if stem not in ("imagenet", "small"):
            raise ValueError(f"stem must be 'imagenet' or 'small', got {stem!r}")
        block, counts = RESNET_STAGES[depth]
        w = base_width
        self.conv1 = (nn.Conv2d(channels, w, 7, 2, 3, bias=False) if stem == "imagenet" else
                      nn.Conv2d(channels, w, 3, 1, 1, bias=False))
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1) if stem == "imagenet" else nn.Identity()
        cin = w
        for i, (width, n) in enumerate(zip((w, 2 * w, 4 * w, 8 * w), counts), start=1):
            stage = []
            for j in range(n):
                stage.append(block(cin, width, 2 if (j == 0 and i > 1) else 1))
                cin = width * block.expansion
            self.add_module(f"layer{i}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        _he_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResNet20(nn.Module):
    """ResNet-20, He et al. 2016's CIFAR-10 network (§4.2, n = 3: 6n + 2 = 20 weight layers).

    A 3×3 conv of 16 channels, then three stages of three :class:`BuildingBlock` s (two 3×3
    convs each) of 16, 32 and 64 channels, the first block of stages 2 and 3 halving the
    resolution (28 → 14 → 7 on Fashion-MNIST; 32 → 16 → 8 on CIFAR); batch norm after every
    conv; global average pool; a linear classifier. Shortcuts are identities throughout, with
    **option A** where the shape changes (:class:`ZeroPadShortcut`: strided, zero-padded
    channels, no parameters), as the paper does for CIFAR ("we use identity shortcuts in all
    cases (i.e., option A)"); so its 0.27 M parameters (269,722 on CIFAR-10; 269,434 with the
    1-channel first conv) are those of Table 6. Initialisation: convs He-normal (fan-out),
    batch norm weight 1 and bias 0, the classifier PyTorch's default, and parameter names
    (``conv1``, ``bn1``, ``layer1``–``layer3``, ``fc``) as :class:`ResNet`'s.
    """

    def __init__(self, classes: int = 10, channels: int = 1, blocks: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        cin = 16
        for i, width in enumerate((16, 32, 64), start=1):
            stage = [BuildingBlock(cin if j == 0 else width, width,
                                   2 if (j == 0 and i > 1) else 1, shortcut="A")
                     for j in range(blocks)]
            self.add_module(f"layer{i}", nn.Sequential(*stage))
            cin = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)
        _he_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# Simonyan & Zisserman 2015, Table 1: configurations D (16 weight layers) and E (19); 0 = max-pool.
VGG_CONFIGS = {16: (64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0,
                    512, 512, 512, 0),
               19: (64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0,
                    512, 512, 512, 512, 0)}


class VGG(nn.Module):
    """VGG-16/19 without batch norm (Simonyan & Zisserman 2015, configurations D and E).

    ``features``: 3×3 convs (padding 1) + ReLU, 2×2 max-pools; an adaptive 7×7 average pool; the
    ``classifier`` 25088 → 4096 → 4096 → ``classes`` with ReLU and dropout. Initialisation:
    convs He-normal (fan-out), linear weights N(0, 0.01²) (the paper's §3.1), biases 0.
    """

    def __init__(self, depth: int = 16, classes: int = 1000, channels: int = 3,
                 dropout: float = 0.5) -> None:
        super().__init__()
        if depth not in VGG_CONFIGS:
            raise ValueError(f"VGG depth must be one of {sorted(VGG_CONFIGS)}, got {depth}")
        layers: list[nn.Module] = []
        cin = channels
        for width in VGG_CONFIGS[depth]:
            if width == 0:
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, width, 3, padding=1), nn.ReLU(inplace=True)]
                cin = width
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(4096, classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class ViTMLP(nn.Sequential):
    """The encoder MLP: Linear → GELU → Dropout → Linear → Dropout (Xavier-uniform weights)."""

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout),
                         nn.Linear(hidden, dim), nn.Dropout(dropout))
        for m in (self[0], self[3]):
            nn.init.xavier_uniform_(m.weight)
            nn.init.normal_(m.bias, std=1e-6)


class ViTBlock(nn.Module):
    """Pre-norm encoder block (Dosovitskiy et al. 2021, Eq. 2–3): x + MSA(LN(x)), then + MLP(LN)."""

    def __init__(self, dim: int, heads: int, mlp: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = ViTMLP(dim, mlp, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.dropout(self.self_attention(y, y, y, need_weights=False)[0])
        return x + self.mlp(self.ln_2(x))


class ViTEncoder(nn.Module):
    """Learned position embeddings (N(0, 0.02²)), ``layers`` blocks, a final layer norm."""

    def __init__(self, tokens: int, layers: int, heads: int, dim: int, mlp: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", ViTBlock(dim, heads, mlp, dropout)) for i in range(layers)))
        self.ln = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class ViT(nn.Module):
    """Vision Transformer (Dosovitskiy et al. 2021, §3.1, Eq. 1–4).

    ``patch``×``patch`` patches embedded by a strided conv (``conv_proj``), a learned class token
    (zeros) prepended, the :class:`ViTEncoder`, and a linear head on the class token's output,
    initialised to zero (the paper's §3.1 head). Defaults: ViT-B/16 at 224 pixels.
    """

    def __init__(self, image_size: int = 224, patch: int = 16, layers: int = 12, heads: int = 12,
                 dim: int = 768, mlp: int = 3072, classes: int = 1000, channels: int = 3,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image_size {image_size} is not a multiple of patch {patch}")
        self.image_size, self.patch, self.dim = image_size, patch, dim
        self.conv_proj = nn.Conv2d(channels, dim, patch, patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder = ViTEncoder((image_size // patch) ** 2 + 1, layers, heads, dim, mlp, dropout)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(dim, classes)))
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / (channels * patch * patch)))
        nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(self.heads.head.weight)
        nn.init.zeros_(self.heads.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"ViT expects {self.image_size}×{self.image_size} images, "
                             f"got {tuple(x.shape[-2:])}")
        x = self.conv_proj(x).flatten(2).transpose(1, 2)  # (B, patches, dim)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


# ---------------------------------------------------------------------------------------------
# Optional dependency: transformers
# ---------------------------------------------------------------------------------------------
def _missing(pkg: str, what: str) -> ImportError:
    return ImportError(f"{what} needs the optional dependency {pkg!r}: {INSTALL_HINT}")


def import_transformers(what: str = "this model"):
    """Import transformers; ``ImportError`` with the install hint when it is not installed."""
    if importlib.util.find_spec("transformers") is None:
        raise _missing("transformers", what)
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise _missing("transformers", what) from e


def hf_classes(what: str, *names: str) -> list[Any]:
    """``transformers``' classes ``names``. transformers imports torchvision whenever one is
    installed; a torchvision built for another torch (an older set-up's) then breaks the model
    classes, and this says so instead of transformers' "Could not import module"."""
    tf = import_transformers(what)
    try:
        return [getattr(tf, n) for n in names]
    except ImportError as e:
        if importlib.util.find_spec("torchvision") is None:
            raise
        raise ImportError(
            f"{what}: transformers could not load {', '.join(names)} because the installed "
            f"torchvision does not work with torch {torch.__version__} ({e.__cause__ or e}). "
            "gradsync needs no torchvision: `pip uninstall torchvision` (make install does "
            "this)") from e


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------
def _resnet(depth: int, classes: int = 10, channels: int = 1, base_width: int = 64) -> nn.Module:
    return ResNet(depth, classes=classes, channels=channels, stem="small", base_width=base_width)


def _vgg(depth: int, classes: int = 10, channels: int = 1) -> nn.Module:
    return nn.Sequential(PadTo(32), VGG(depth, classes=classes, channels=channels))


_VIT_DIMS = {"vit": (12, 3, 192, 768), "vit_large": (24, 16, 1024, 4096)}  # layers, heads, d, mlp


def _vit(size: str, classes: int = 10, channels: int = 1, image_size: int = 28,
         patch_size: int = 4) -> nn.Module:
    layers, heads, dim, mlp = _VIT_DIMS[size]
    return ViT(image_size, patch_size, layers, heads, dim, mlp, classes=classes,
               channels=channels)


# GPT-2 / BERT configs. "large" are the published ones (gpt2-large: 36 × 1280, 20 heads,
# vocab 50257, 1024 positions; bert-large-uncased: 24 × 1024, 16 heads, 4096, vocab 30522).
_GPT2 = {
    "gpt2_small": dict(vocab_size=257, n_positions=128, n_embd=128, n_layer=4, n_head=4,
                       bos_token_id=256, eos_token_id=256),
    "gpt2_large": dict(vocab_size=50257, n_positions=1024, n_embd=1280, n_layer=36, n_head=20),
}
_BERT = {
    "bert_small": dict(vocab_size=257, max_position_embeddings=128, hidden_size=128,
                       num_hidden_layers=4, num_attention_heads=4, intermediate_size=512),
    "bert_large": dict(vocab_size=30522, max_position_embeddings=512, hidden_size=1024,
                       num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def _gpt2(size: str, **overrides: Any) -> nn.Module:
    config, model = hf_classes(size, "GPT2Config", "GPT2LMHeadModel")
    cfg = config(**{**_GPT2[size], **overrides})
    return HFLogits(model(cfg), context=min(cfg.n_positions, 128))


def _bert(size: str, **overrides: Any) -> nn.Module:
    config, model = hf_classes(size, "BertConfig", "BertForMaskedLM")
    cfg = config(**{**_BERT[size], **overrides})
    return HFLogits(model(cfg), context=min(cfg.max_position_embeddings, 128))


@dataclass(frozen=True)
class _Spec:
    builder: Callable[..., nn.Module]
    task: str  # "image" | "causal_lm" | "masked_lm"
    needs: str | None = None  # optional dependency


def _partial(fn: Callable[..., nn.Module], *a: Any) -> Callable[..., nn.Module]:
    return lambda **kw: fn(*a, **kw)


_SPECS: dict[str, _Spec] = {
    "cnn": _Spec(CNN, "image"),
    "mlp": _Spec(MLP, "image"),
    "resnet18": _Spec(ResNet18, "image"),
    "resnet20": _Spec(ResNet20, "image"),
    "resnet50": _Spec(_partial(_resnet, 50), "image"),
    "resnet152": _Spec(_partial(_resnet, 152), "image"),
    "vgg16": _Spec(_partial(_vgg, 16), "image"),
    "vgg19": _Spec(_partial(_vgg, 19), "image"),
    "vit": _Spec(_partial(_vit, "vit"), "image"),
    "vit_large": _Spec(_partial(_vit, "vit_large"), "image"),
    "gpt_tiny": _Spec(TinyGPT, "causal_lm"),
    "gpt2_small": _Spec(_partial(_gpt2, "gpt2_small"), "causal_lm", "transformers"),
    "gpt2_large": _Spec(_partial(_gpt2, "gpt2_large"), "causal_lm", "transformers"),
    "bert_small": _Spec(_partial(_bert, "bert_small"), "masked_lm", "transformers"),
    "bert_large": _Spec(_partial(_bert, "bert_large"), "masked_lm", "transformers"),
    "lstm": _Spec(LSTMLM, "causal_lm"),
}
_BUILDERS = {name: spec.builder for name, spec in _SPECS.items()}  # kept for older callers


def names() -> list[str]:
    """Every model name (those needing an optional dependency included)."""
    return sorted(_SPECS)


def _spec(name: str) -> _Spec:
    if name not in _SPECS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(names())}")
    return _SPECS[name]


def task(name: str) -> str:
    """``"image"`` (Fashion-MNIST), ``"causal_lm"`` or ``"masked_lm"`` (text corpus)."""
    return _spec(name).task


def requires(name: str) -> str | None:
    """The optional dependency model ``name`` needs (``None``: plain torch)."""
    return _spec(name).needs


def build(name: str, seed: int = 0, *, device: torch.device | str | None = None,
          **kwargs: Any) -> nn.Module:
    """Build model ``name`` deterministically from ``seed`` (global RNG left untouched).

    ``device="meta"`` allocates nothing (shapes and parameter counts only). ``kwargs`` go to the
    model's constructor (e.g. ``classes=``, ``vocab=`` for ``lstm``, config fields for
    ``gpt2_*``/``bert_*``). A missing optional dependency raises ``ImportError`` naming
    ``pip install 'gradsync[models]'``.
    """
    spec = _spec(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if device is None:
            return spec.builder(**kwargs)
        with torch.device(device):
            return spec.builder(**kwargs)


def reference(name: str, *, device: torch.device | str | None = "meta") -> nn.Module:
    """The *published* definition (no Fashion-MNIST adaptation), on ``device`` (meta: no memory).

    ``resnet18``/``resnet50``/``resnet152``/``vgg16``/``vgg19`` at 224 pixels, 3 channels and
    1000 classes (ImageNet stem); ``resnet20`` the CIFAR-10 network (3 channels, 10 classes,
    32 pixels); ``vit`` is ViT-B/16 and ``vit_large`` ViT-L/16 (224 pixels,
    1000 classes); ``bert_large``/``gpt2_large`` are their zoo builds. Used for SSFusion Table II
    (small-tensor census). Seed 0.
    """
    published: dict[str, Callable[[], nn.Module]] = {
        "resnet18": lambda: ResNet(18), "resnet50": lambda: ResNet(50),
        "resnet152": lambda: ResNet(152), "vgg16": lambda: VGG(16), "vgg19": lambda: VGG(19),
        "resnet20": lambda: ResNet20(channels=3),  # CIFAR-10: 3 channels, 10 classes
        "vit": lambda: ViT(),  # ViT-B/16
        "vit_large": lambda: ViT(layers=24, heads=16, dim=1024, mlp=4096),  # ViT-L/16
        "bert_large": _spec("bert_large").builder, "gpt2_large": _spec("gpt2_large").builder,
    }
    if name not in published:
        raise ValueError(f"no published reference definition for {name!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return published[name]()


# ---------------------------------------------------------------------------------------------
# Natural data and loss
# ---------------------------------------------------------------------------------------------
def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for every zoo model: class logits ``(B, C)`` vs ``(B,)``, or token logits
    ``(B, T, V)`` vs ``(B, T)`` targets (−100 = ignored: the unmasked positions of BERT)."""
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1),
                                       ignore_index=-100)


def _tokenizer(name: str, net: nn.Module | None, fallback: bool):
    from gradsync.apps import data

    if name == "lstm":
        vocab = net.vocab if net is not None else 10_000
        return data.word_tokenizer(max_vocab=vocab, fallback=fallback)
    return data.ByteTokenizer()


def batches(
    name: str, batch_size: int, seed: int = 0, *, model: nn.Module | None = None,
    seq_len: int | None = None, train: bool = True, fallback: bool = False,
    limit: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(inputs, targets)`` batches of model ``name``'s natural data, seeded.

    Images: Fashion-MNIST (``DatasetUnavailable`` when not installed; ``limit`` caps the images
    read). Language models: the offline text corpus (``gradsync.apps.data.text_corpus``; with
    ``fallback=True`` this package's source text when the corpus is missing), byte ids or (lstm)
    word ids, ``seq_len`` tokens (default: the model's context, at most 128), causal or masked
    targets per :func:`task`. ``model`` (the built model) supplies context and vocabulary.
    """
    from gradsync.apps import data

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    kind = task(name)
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        x, y = data.fashion_mnist(train=train, limit=limit)

        def images() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            while True:
                i = torch.randint(len(x), (batch_size,), generator=g)
                yield x[i], y[i]

        return images()
    tok = _tokenizer(name, model, fallback)
    tokens = data.corpus_tokens(tok, fallback=fallback)
    ctx = getattr(model, "context", None) or 128
    T = int(seq_len or min(ctx, 128))
    return data.lm_batches(tokens, batch_size, T, kind="masked" if kind == "masked_lm" else
                           "causal", seed=seed, mask_id=tok.mask_id,
                           random_high=tok.regular_size)


def _source_text_batches(net: TinyGPT, batch_size: int, g: torch.Generator):
    """gpt_tiny's historical data: the bytes of this package's own source text."""
    text = b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.rglob("*.py")))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    ctx = net.context
    while True:
        starts = torch.randint(len(data) - ctx - 1, (batch_size,), generator=g)
        xb = torch.stack([data[s: s + ctx] for s in starts.tolist()])
        yb = torch.stack([data[s + 1: s + ctx + 1] for s in starts.tolist()])
        yield xb, yb


def gradient_steps(
    model: str = "cnn", steps: int = 5, batch_size: int = 64, lr: float = 0.05, seed: int = 0,
    fallback: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Train ``model`` ``steps`` SGD steps (momentum 0.9) on its natural data, yielding each
    step's per-parameter gradients (fresh tensors) before the step is applied."""
    net = build(model, seed=seed)
    net.train()
    g = torch.Generator().manual_seed(seed)
    if model == "gpt_tiny":
        it: Iterator = _source_text_batches(net, batch_size, g)
    elif task(model) == "image":
        it = batches(model, batch_size, seed=seed, limit=batch_size * max(steps, 1) * 4)
    else:
        it = batches(model, batch_size, seed=seed, model=net, fallback=fallback)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    for _ in range(max(1, steps)):
        xb, yb = next(it)
        opt.zero_grad(set_to_none=True)
        value = loss(net(xb), yb)
        if not math.isfinite(value.detach().item()):
            raise RuntimeError(f"{model}: non-finite loss while sampling gradients")
        value.backward()
        yield {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
               for n, p in net.named_parameters()}
        opt.step()


def real_gradients(
    model: str = "cnn", steps: int = 5, batch_size: int = 64, lr: float = 0.05, seed: int = 0,
    accumulate: bool = False, fallback: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-parameter gradients of ``model`` after ``steps`` SGD steps on real data.

    Image models train on Fashion-MNIST (raises ``DatasetUnavailable`` when it is not installed);
    ``gpt_tiny`` trains on the bytes of this package's own source text; the other language
    models on the offline text corpus (``fallback=True``: the source text when it is missing).
    With ``accumulate=True`` the gradients of all steps are summed (what a residual accumulates
    when nothing is sent), which is the input DenseStream Table I measures.
    """
    total: dict[str, torch.Tensor] | None = None
    last: dict[str, torch.Tensor] = {}
    for grads in gradient_steps(model, steps, batch_size, lr, seed, fallback=fallback):
        last = grads
        if total is None:
            total = {n: g.clone() for n, g in grads.items()}
        else:
            for n, g in grads.items():
                total[n] += g
    return total if accumulate and total is not None else last


def model_step(name: str, batch: int, seed: int, rank: int = 0,
               device: torch.device | str | None = None):
    """``(model, step)`` for timing: ``models.build(name, seed)`` and a closure that runs the
    forward pass on fixed seeded random inputs (bytes for ``gpt_tiny``, 28×28 images otherwise)
    and returns the loss. ``rank`` varies the inputs, not the weights."""
    net = build(name, seed=seed).to(device or "cpu")
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if name == "gpt_tiny":
        x = torch.randint(256, (batch, net.context), generator=g).to(device or "cpu")
        y = torch.randint(256, (batch, net.context), generator=g).to(device or "cpu")

        def step() -> torch.Tensor:
            out = net(x)
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    else:
        x = torch.randn(batch, 1, 28, 28, generator=g).to(device or "cpu")
        y = torch.randint(10, (batch,), generator=g).to(device or "cpu")

        def step() -> torch.Tensor:
            return nn.functional.cross_entropy(net(x), y)

    return net, step
