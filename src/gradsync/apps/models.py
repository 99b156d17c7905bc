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
resnet50/152      torchvision ``resnet50``/``resnet152``                  Fashion-MNIST
vgg16/19          torchvision ``vgg16``/``vgg19`` (no batch norm)         Fashion-MNIST
vit               torchvision ``VisionTransformer``, ViT-Tiny dims        Fashion-MNIST
vit_large         torchvision ViT-L/16 layers (24 × 1024, 16 heads)       Fashion-MNIST
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
  ``resnet18`` here. Every other layer is torchvision's.
* VGG-16/19: the first conv takes 1 channel and the images are zero-padded to 32 × 32 so that
  the five 2×2 max-pools end at 1 × 1 (28 would end at 0); torchvision's adaptive 7 × 7 pool and
  its 25088-4096-4096 classifier are kept (so the parameter count is the paper's, 134/139 M).
* ViT: image 28, patch 4 (7 × 7 = 49 patches + a class token), patch embedding on 1 channel.
* ``reference(name)`` gives the *unadapted* published definitions (ResNet-152 and ViT-L/16 at
  224 pixels and 1000 classes, bert-large, gpt2-large) for the SSFusion Table II census.

Language models: ``gpt2_*``/``bert_*``/``gpt_tiny`` read bytes (``data.ByteTokenizer``,
256 byte ids + a mask id 256); ``lstm`` reads words (``data.WordTokenizer`` built from
the corpus, its vocabulary size is the model's). GPT-2 is a causal LM (next-token targets),
BERT a masked LM (15 % of positions; 80/10/10 mask/random/keep; other targets −100).

torchvision and transformers are optional (``pip install 'gradsync[models]'``; ``make install``
installs them). The PyPI torchvision wheel is built against CUDA torch; with the CPU torch pinned
here its C++ extension (detection ops: nms, roi_align, …) cannot load, and torchvision's import
then fails on ``register_fake("torchvision::nms")``. :func:`import_torchvision` defines the two
op schemas that import needs when (and only when) the extension did not load, so the pure-Python
model definitions import and run; the detection ops themselves stay unavailable.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "CNN", "LSTMLM", "MLP", "ResNet18", "TinyGPT", "batches", "build", "gradient_steps",
    "import_torchvision", "import_transformers", "loss", "names", "real_gradients", "reference",
    "requires", "task",
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
# Optional dependencies
# ---------------------------------------------------------------------------------------------
_TORCHVISION_SHIM: list[Any] = []  # keeps the schema Library alive (it unregisters when freed)


def _missing(pkg: str, what: str) -> ImportError:
    return ImportError(f"{what} needs the optional dependency {pkg!r}: {INSTALL_HINT}")


def import_torchvision(what: str = "this model"):
    """Import torchvision's model definitions with the CPU torch pinned here.

    When torchvision's C++ extension cannot load (the PyPI wheel links CUDA libraries absent
    with CPU torch), define the schemas of ``torchvision::nms``/``qnms`` that its import
    registers fake kernels for; nothing else changes. Raises ``ImportError`` with the install
    hint when torchvision is not installed.
    """
    if "torchvision" not in sys.modules:
        spec = importlib.util.find_spec("torchvision")
        if spec is None or spec.origin is None:
            raise _missing("torchvision", what)
        if not _torchvision_ops_loadable(Path(spec.origin).parent) and not _TORCHVISION_SHIM:
            lib = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _TORCHVISION_SHIM.append(lib)
    try:
        return importlib.import_module("torchvision.models")
    except ImportError as e:
        raise _missing("torchvision", what) from e


def _torchvision_ops_loadable(folder: Path) -> bool:
    if hasattr(torch.ops.torchvision, "nms"):
        return True
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        lib = folder / f"_C{suffix}"
        if lib.exists():
            try:
                torch.ops.load_library(str(lib))
                return True
            except (OSError, RuntimeError):
                return False
    return False


def import_transformers(what: str = "this model"):
    """Import transformers (it imports torchvision when present: made importable first)."""
    if importlib.util.find_spec("transformers") is None:
        raise _missing("transformers", what)
    if importlib.util.find_spec("torchvision") is not None:
        import_torchvision(what)
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise _missing("transformers", what) from e


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------
def _resnet_tv(depth: int, classes: int = 10, channels: int = 1) -> nn.Module:
    tvm = import_torchvision(f"resnet{depth}")
    net = getattr(tvm, f"resnet{depth}")(weights=None, num_classes=classes)
    net.conv1 = nn.Conv2d(channels, 64, 3, 1, 1, bias=False)
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    net.maxpool = nn.Identity()
    return net


def _vgg_tv(depth: int, classes: int = 10, channels: int = 1) -> nn.Module:
    tvm = import_torchvision(f"vgg{depth}")
    net = getattr(tvm, f"vgg{depth}")(weights=None, num_classes=classes)
    old = net.features[0]
    conv = nn.Conv2d(channels, old.out_channels, 3, padding=1)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    nn.init.zeros_(conv.bias)
    net.features[0] = conv
    return nn.Sequential(PadTo(32), net)


_VIT_DIMS = {"vit": (12, 3, 192, 768), "vit_large": (24, 16, 1024, 4096)}  # layers, heads, d, mlp


def _vit_tv(size: str, classes: int = 10, channels: int = 1, image_size: int = 28,
            patch_size: int = 4) -> nn.Module:
    tvm = import_torchvision(size)
    layers, heads, dim, mlp = _VIT_DIMS[size]
    net = tvm.VisionTransformer(image_size=image_size, patch_size=patch_size, num_layers=layers,
                                num_heads=heads, hidden_dim=dim, mlp_dim=mlp, num_classes=classes)
    old = net.conv_proj
    net.conv_proj = nn.Conv2d(channels, dim, patch_size, patch_size)
    fan_in = channels * patch_size * patch_size  # torchvision's own init of conv_proj
    nn.init.trunc_normal_(net.conv_proj.weight, std=math.sqrt(1 / fan_in))
    nn.init.zeros_(net.conv_proj.bias)
    del old
    return net


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
    tf = import_transformers(size)
    cfg = tf.GPT2Config(**{**_GPT2[size], **overrides})
    return HFLogits(tf.GPT2LMHeadModel(cfg), context=min(cfg.n_positions, 128))


def _bert(size: str, **overrides: Any) -> nn.Module:
    tf = import_transformers(size)
    cfg = tf.BertConfig(**{**_BERT[size], **overrides})
    return HFLogits(tf.BertForMaskedLM(cfg), context=min(cfg.max_position_embeddings, 128))


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
    "resnet50": _Spec(_partial(_resnet_tv, 50), "image", "torchvision"),
    "resnet152": _Spec(_partial(_resnet_tv, 152), "image", "torchvision"),
    "vgg16": _Spec(_partial(_vgg_tv, 16), "image", "torchvision"),
    "vgg19": _Spec(_partial(_vgg_tv, 19), "image", "torchvision"),
    "vit": _Spec(_partial(_vit_tv, "vit"), "image", "torchvision"),
    "vit_large": _Spec(_partial(_vit_tv, "vit_large"), "image", "torchvision"),
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

    ``resnet152``/``resnet50``/``vgg16``/``vgg19`` and ``vit_large`` (ViT-L/16) at 224 pixels,
    3 channels and 1000 classes; ``bert_large``/``gpt2_large`` are their zoo builds. Used for
    SSFusion Table II (small-tensor census). Seed 0.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            if name in ("resnet50", "resnet152", "vgg16", "vgg19", "resnet18"):
                return getattr(import_torchvision(name), name)(weights=None)
            if name == "vit_large":
                return import_torchvision(name).vit_l_16(weights=None)
            if name == "vit":
                return import_torchvision(name).vit_b_16(weights=None)
            if name in ("bert_large", "gpt2_large"):
                return _spec(name).builder()
    raise ValueError(f"no published reference definition for {name!r}")


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
