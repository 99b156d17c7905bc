"""The model zoo and the offline text corpus.

Every zoo model builds deterministically from its seed without touching the global RNG and runs a
forward/backward pass on a tiny batch of its natural data. The small ones do so for real; the
paper-scale ones (hundreds of millions of parameters) on the meta device in CI, and for real
under ``-m slow``. A missing optional dependency fails these tests with the install hint (the
set-up installs ``gradsync[models]``); it is never skipped.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch

from gradsync.apps import data, models

SMALL = ["cnn", "mlp", "resnet18", "resnet20", "resnet50", "vit", "gpt_tiny", "gpt2_small",
         "bert_small", "lstm"]
LARGE = ["resnet152", "vgg16", "vgg19", "vit_large", "gpt2_large", "bert_large"]


def test_names_cover_the_zoo():
    assert sorted(SMALL + LARGE) == models.names()
    for name in SMALL + LARGE:
        assert models.task(name) in ("image", "causal_lm", "masked_lm")
    with pytest.raises(ValueError, match="unknown model"):
        models.build("resnet9000")


def test_optional_dependencies_installed_and_torch_kept():
    # The set-up installs gradsync[models]; without it this fails with the install hint.
    tf = models.import_transformers()
    assert hasattr(tf, "GPT2LMHeadModel")
    assert torch.__version__.split("+")[0] == "2.13.0"  # transformers did not pull another torch
    # ResNet/VGG/ViT are gradsync's own definitions: no optional dependency.
    for name in ("resnet50", "resnet152", "vgg16", "vgg19", "vit", "vit_large"):
        assert models.requires(name) is None, name
    assert models.requires("gpt2_small") == "transformers"


def _digest(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _batch(name: str, net: torch.nn.Module, device: str | None = None):
    x, y = next(models.batches(name, 2, seed=3, model=net, seq_len=16, limit=64))
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


@pytest.mark.parametrize("name", SMALL)
def test_small_model_deterministic_forward_backward(name):
    rng = torch.get_rng_state()
    a, b = models.build(name, seed=5), models.build(name, seed=5)
    c = models.build(name, seed=6)
    assert torch.equal(torch.get_rng_state(), rng), "build touched the global RNG"
    da, db, dc = _digest(a), _digest(b), _digest(c)
    assert all(torch.equal(u, v) for u, v in zip(da, db, strict=True))
    assert not all(torch.equal(u, v) for u, v in zip(da, dc, strict=True))

    x, y = _batch(name, a)
    out = a(x)
    if models.task(name) == "image":
        assert x.shape == (2, 1, 28, 28) and out.shape == (2, 10)
    else:
        assert out.shape[:2] == x.shape == y.shape
        assert int(x.max()) < out.shape[-1]  # ids fit the model's vocabulary
    loss = models.loss(out, y)
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in a.parameters()]
    assert all(g is None or bool(torch.isfinite(g).all()) for g in grads)
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads)


@pytest.mark.parametrize("name", LARGE)
def test_large_model_meta_forward_backward(name):
    net = models.build(name, seed=0, device="meta")
    params = list(net.parameters())
    assert params and all(p.is_meta for p in params)
    x, y = _batch(name, net, device="meta")
    out = net(x)
    models.loss(out, y).backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)
    if models.task(name) == "image":
        assert out.shape == (2, 10)
    else:
        assert out.shape[:2] == (2, 16)


def test_resnet152_builds_deterministically():
    a, b = models.build("resnet152", seed=1), models.build("resnet152", seed=1)
    assert all(torch.equal(u, v) for u, v in zip(_digest(a), _digest(b), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", LARGE)
def test_large_model_real_deterministic_forward_backward(name):
    a, b = models.build(name, seed=2), models.build(name, seed=2)
    assert all(torch.equal(u, v) for u, v in zip(_digest(a), _digest(b), strict=True))
    del b
    x, y = _batch(name, a)
    loss = models.loss(a(x), y)
    loss.backward()
    assert torch.isfinite(loss)


def test_published_parameter_counts():
    # Counts from torchvision's and the model cards' documentation, not from this code.
    expected = {"resnet18": 11_689_512, "resnet50": 25_557_032, "resnet152": 60_192_808,
                "vgg16": 138_357_544, "vgg19": 143_667_240, "vit": 86_567_656,  # ViT-B/16
                "vit_large": 304_326_632, "gpt2_large": 774_030_080}
    for name, count in expected.items():
        net = models.reference(name, device="meta")
        assert sum(p.numel() for p in net.parameters()) == count, name
    # The Fashion-MNIST ResNet-152 differs from the published one only in stem and classes.
    fm = sum(p.numel() for p in models.build("resnet152", device="meta").parameters())
    assert fm == 60_192_808 - 3 * 7 * 7 * 64 + 3 * 3 * 64 - 2048 * 990 - 990



def _resnet20_by_hand(channels: int) -> tuple[int, int, int]:
    """(parameters, parameter tensors, batch norms) of He et al.'s CIFAR ResNet-20 with option A
    shortcuts, from the architecture alone: 3×3 convs without bias, BN (γ, β) after each, no
    shortcut parameters, a 64 → 10 linear layer."""
    def conv(cin, cout):
        return 3 * 3 * cin * cout

    def bn(c):
        return 2 * c

    convs = [(channels, 16)]  # the first conv
    cin = 16
    for width in (16, 32, 64):  # three stages of three blocks, two convs each
        for _ in range(3):
            convs += [(cin, width), (width, width)]
            cin = width
    params = sum(conv(a, b) + bn(b) for a, b in convs) + 64 * 10 + 10
    return params, 3 * len(convs) + 2, len(convs)  # conv weight, γ, β each; fc weight, bias


def test_resnet20_matches_the_paper_by_hand():
    # 6n + 1 = 19 convs (n = 3) and the classifier: 20 weight layers
    assert _resnet20_by_hand(3) == (269_722, 59, 19)  # the CIFAR-10 network: "0.27M"
    assert _resnet20_by_hand(1) == (269_434, 59, 19)  # 1-channel first conv: 2 · 16 · 9 fewer
    net = models.build("resnet20", seed=0)
    params = list(net.parameters())
    assert sum(p.numel() for p in params) == 269_434 and len(params) == 59
    bns = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(bns) == len(convs) == 19 and all(c.bias is None for c in convs)
    assert [b.num_features for b in bns] == [16] * 7 + [32] * 6 + [64] * 6
    assert len(list(net.buffers())) == 3 * 19  # running mean, var, batches tracked
    # option A: the two downsampling shortcuts carry no parameters
    for stage in (net.layer2, net.layer3):
        assert isinstance(stage[0].downsample, models.ZeroPadShortcut)
        assert not list(stage[0].downsample.parameters())
    assert all(b.downsample is None for b in (*net.layer1, *net.layer2[1:], *net.layer3[1:]))
    ref = models.reference("resnet20", device="meta")
    assert sum(p.numel() for p in ref.parameters()) == 269_722
    assert tuple(ref.conv1.weight.shape) == (16, 3, 3, 3)
    assert tuple(net.conv1.weight.shape) == (16, 1, 3, 3)
    assert tuple(net.fc.weight.shape) == (10, 64)
    net.train()
    x = torch.randn(5, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    feats = net.layer3(net.layer2(net.layer1(net.relu(net.bn1(net.conv1(x))))))
    assert feats.shape == (5, 64, 7, 7)  # 28 → 14 → 7
    out = net(x)
    assert out.shape == (5, 10) and bool(torch.isfinite(out).all())
    assert float(bns[0].running_mean.abs().sum()) > 0  # BN ran in training mode
    assert ref(torch.zeros(2, 3, 32, 32, device="meta")).shape == (2, 10)


def test_zero_pad_shortcut_is_a_strided_identity():
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    y = models.ZeroPadShortcut(3, 8, 2)(x)
    assert y.shape == (2, 8, 2, 2)
    assert torch.equal(y[:, 2:5], x[:, :, ::2, ::2])  # (8 − 3) // 2 = 2 zero channels first
    assert not y[:, :2].any() and not y[:, 5:].any()
    with pytest.raises(ValueError, match="option A"):
        models.ZeroPadShortcut(8, 3, 1)
    with pytest.raises(ValueError, match="shortcut"):
        models.BuildingBlock(16, 32, 2, shortcut="C")

# Derived from torchvision 0.28.0 (the release for torch 2.13.0) before gradsync dropped it: for
# the published models (``reference``: torchvision's resnet18/50/152, vgg16/19, vit_b_16,
# vit_l_16 with weights=None) and the zoo's Fashion-MNIST builds as gradsync made them from
# torchvision (stem/first conv/patch embedding replaced as the models docstring says), the number
# of parameter tensors, of parameters, of buffers, and the first 16 hex digits of the SHA-256 of
# "name:d0xd1x…" for every named parameter in order, joined by ";".
TORCHVISION_LAYOUT = {
    "build:resnet50": (161, 23_519_690, 159, "0036aeee9e535b6c"),
    "build:resnet152": (467, 58_155_466, 465, "b1d12c86daa5e1d6"),
    "build:vgg16": (32, 134_300_362, 0, "69419b5ba74cf152"),
    "build:vgg19": (38, 139_610_058, 0, "8e4252d93ccaf53d"),
    "build:vit": (152, 5_353_738, 0, "2bf7f73f6f873c0b"),
    "build:vit_large": (296, 302_391_306, 0, "4644d859f4701c29"),
    "reference:resnet18": (62, 11_689_512, 60, "59a11ecb23ba6b5b"),
    "reference:resnet50": (161, 25_557_032, 159, "c37ec69c5de4357a"),
    "reference:resnet152": (467, 60_192_808, 465, "fa33a3a949fc77de"),
    "reference:vgg16": (32, 138_357_544, 0, "1e00765c2426fca6"),
    "reference:vgg19": (38, 143_667_240, 0, "e227b7d6e2461316"),
    "reference:vit": (152, 86_567_656, 0, "79bfc889022aea6f"),
    "reference:vit_large": (296, 304_326_632, 0, "b8d8480cf1fdc604"),
}


def _layout(net: torch.nn.Module) -> tuple[int, int, int, str]:
    named = list(net.named_parameters())
    text = ";".join(f"{n}:{'x'.join(map(str, p.shape))}" for n, p in named)
    return (len(named), sum(p.numel() for _, p in named), len(list(net.buffers())),
            hashlib.sha256(text.encode()).hexdigest()[:16])


@pytest.mark.parametrize("key", sorted(TORCHVISION_LAYOUT))
def test_vision_models_have_torchvisions_layout(key):
    kind, name = key.split(":")
    net = (models.build(name, device="meta") if kind == "build" else
           models.reference(name, device="meta"))
    assert _layout(net) == TORCHVISION_LAYOUT[key]


def test_vision_model_shapes_by_hand():
    shapes = {k: tuple(p.shape) for k, p in models.reference("resnet152").named_parameters()}
    assert shapes["conv1.weight"] == (64, 3, 7, 7)  # ImageNet stem
    assert shapes["layer3.35.conv3.weight"] == (1024, 256, 1, 1)  # 36 blocks in stage 3
    assert shapes["layer4.0.downsample.0.weight"] == (2048, 1024, 1, 1)
    assert shapes["fc.weight"] == (1000, 2048)
    fm = {k: tuple(p.shape) for k, p in models.build("resnet50", device="meta").named_parameters()}
    assert fm["conv1.weight"] == (64, 1, 3, 3) and fm["fc.weight"] == (10, 2048)
    vgg = {k: tuple(p.shape) for k, p in models.build("vgg19", device="meta").named_parameters()}
    assert vgg["1.features.0.weight"] == (64, 1, 3, 3)
    assert vgg["1.classifier.0.weight"] == (4096, 512 * 7 * 7)
    assert sum(k.endswith("weight") and v[-1] == 3 for k, v in vgg.items()) == 16  # 16 convs
    vit = {k: tuple(p.shape) for k, p in models.reference("vit_large").named_parameters()}
    assert vit["conv_proj.weight"] == (1024, 3, 16, 16)
    assert vit["encoder.pos_embedding"] == (1, 14 * 14 + 1, 1024)
    assert vit["encoder.layers.encoder_layer_23.self_attention.in_proj_weight"] == (3 * 1024, 1024)
    assert vit["encoder.layers.encoder_layer_23.mlp.0.weight"] == (4096, 1024)
    tiny = {k: tuple(p.shape) for k, p in models.build("vit", device="meta").named_parameters()}
    assert tiny["conv_proj.weight"] == (192, 1, 4, 4)
    assert tiny["encoder.pos_embedding"] == (1, 7 * 7 + 1, 192)


def test_vision_initialisation_follows_the_papers():
    net = models.build("vgg16", seed=0)
    fc = net[1].classifier[0].weight
    assert abs(fc.std().item() - 0.01) < 1e-4 and not net[1].classifier[0].bias.any()
    conv = net[1].features[2].weight  # He normal, fan-out: std = sqrt(2 / (64 · 9))
    he = (2 / (64 * 9)) ** 0.5
    assert abs(conv.std().item() / he - 1) < 0.03  # 36,864 samples: ±0.4 % is one sigma
    res = models.build("resnet50", seed=0)
    assert bool((res.layer1[0].bn1.weight == 1).all()) and not res.layer1[0].bn1.bias.any()
    vit = models.build("vit", seed=0)
    assert not vit.heads.head.weight.any() and not vit.class_token.any()  # zero head and token
    assert abs(vit.encoder.pos_embedding.std().item() - 0.02) < 0.002


def test_missing_dependency_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "transformers" else real(n, *a))
    with pytest.raises(ImportError, match=r"gradsync\[models\]"):
        models.build("gpt2_small")
    # The vision models need nothing optional: they build with torchvision unimportable.
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.models", None)
    assert models.build("resnet50", device="meta").fc.out_features == 10


class _BrokenTransformers(types.ModuleType):
    """transformers as it behaves when an installed torchvision cannot load."""

    def __getattr__(self, name: str):
        raise ModuleNotFoundError(f"Could not import module {name!r}.")


def test_a_broken_torchvision_is_named(monkeypatch):
    fake = _BrokenTransformers("transformers")
    fake.__spec__ = importlib.machinery.ModuleSpec("transformers", None)
    monkeypatch.setitem(sys.modules, "transformers", fake)
    real = importlib.util.find_spec
    torchvision_present = {"value": True}

    def find_spec(n, *a):
        if n == "torchvision":
            return importlib.machinery.ModuleSpec(n, None) if torchvision_present["value"] else None
        return real(n, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match="pip uninstall torchvision"):
        models.build("gpt2_small")
    torchvision_present["value"] = False  # then transformers' own error is not reworded
    with pytest.raises(ImportError, match="Could not import module") as e:
        models.build("bert_small")
    assert "torchvision" not in str(e.value)


def test_real_gradients_of_a_language_model():
    g = models.real_gradients("gpt2_small", steps=2, batch_size=2)
    n = dict(models.build("gpt2_small").named_parameters())
    assert list(g) == list(n) and all(g[k].shape == n[k].shape for k in g)
    assert all(bool(torch.isfinite(v).all()) for v in g.values())
    acc = models.real_gradients("gpt2_small", steps=2, batch_size=2, accumulate=True)
    assert any(not torch.equal(acc[k], g[k]) for k in g)


# -- text corpus ------------------------------------------------------------------------------
def test_text_corpus_loads_real_english():
    text = data.text_corpus()
    assert len(text) > 1_000_000
    words = text.lower().split()
    for w in ("the", "and", "love", "computer"):
        assert w in words
    assert "\n%\n" not in text  # fortune separators removed
    assert data.text_corpus(limit=100) == text[:100]


def test_text_corpus_missing_is_explicit(tmp_path):
    with pytest.raises(data.DatasetUnavailable, match="apt-get install fortunes"):
        data.text_corpus(tmp_path / "nothing")
    src = data.text_corpus(tmp_path / "nothing", fallback=True)
    assert "def text_corpus" in src


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    s = "Grüße, world!\n"
    ids = tok.encode(s)
    assert ids.dtype == torch.int64 and ids.tolist() == list(s.encode("utf-8"))
    assert tok.decode(ids) == s
    assert tok.vocab_size == 257 and tok.mask_id == 256


def test_word_tokenizer_by_hand():
    tok = data.WordTokenizer.build("the cat, the dog\nthe end", max_vocab=100)
    # counts: the 3; cat, dog, end, "," 1 each (ties alphabetical: "," < cat < dog < end)
    assert tok.itos == ["<unk>", "<eos>", "<mask>", "the", ",", "cat", "dog", "end"]
    assert tok.encode("the cat, the dog\nthe end").tolist() == [3, 5, 4, 3, 6, 1, 3, 7]
    assert tok.encode("the zebra").tolist() == [3, 0]
    small = data.WordTokenizer.build("the cat, the dog\nthe end", max_vocab=5)
    assert small.vocab_size == 5 and small.encode("dog the").tolist() == [0, 3]
    with pytest.raises(ValueError):
        data.WordTokenizer.build("x", max_vocab=2)


def test_causal_batches_are_shifted_windows():
    tokens = torch.arange(10_000, dtype=torch.int64)
    rng = torch.get_rng_state()
    a = list(data.lm_batches(tokens, 4, 16, seed=1, steps=3))
    b = list(data.lm_batches(tokens, 4, 16, seed=1, steps=3))
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(a) == 3
    for (x, y), (x2, y2) in zip(a, b, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert x.shape == y.shape == (4, 16)
        assert torch.equal(y, x + 1)  # next token of a contiguous window
        assert torch.equal(x - x[:, :1], torch.arange(16).expand(4, 16))


def test_masked_batches_follow_bert():
    tokens = torch.arange(50_000, dtype=torch.int64)
    x, y = next(data.lm_batches(tokens, 256, 64, kind="masked", seed=0, mask_id=-7,
                                random_high=50))
    chosen = y != -100
    rate = chosen.float().mean().item()
    assert 0.13 < rate < 0.18
    # Reconstruct each row's true window from one unchosen position (tokens = arange).
    j = (~chosen).int().argmax(dim=1)
    rows = torch.arange(256)
    truth = (x[rows, j] - j)[:, None] + torch.arange(64)
    assert torch.equal(x[~chosen], truth[~chosen])
    assert torch.equal(y[chosen], truth[chosen])
    xc, tc = x[chosen], truth[chosen]
    masked = (xc == -7).float().mean().item()
    kept = (xc == tc).float().mean().item()
    assert 0.75 < masked < 0.85 and 0.06 < kept < 0.14
    other = xc[(xc != -7) & (xc != tc)]
    assert bool(((other >= 0) & (other < 50)).all())
    assert bool(chosen.any(dim=1).all())  # at least one target per row


def test_lm_batches_reject_bad_input():
    t = torch.arange(100)
    with pytest.raises(ValueError):
        next(data.lm_batches(t.float(), 2, 8))
    with pytest.raises(ValueError):
        next(data.lm_batches(t, 2, 200))
    with pytest.raises(ValueError):
        next(data.lm_batches(t, 2, 8, kind="masked"))
    with pytest.raises(ValueError):
        next(data.lm_batches(t, 2, 8, kind="prefix"))


def test_lstm_uses_the_corpus_word_vocabulary():
    net = models.build("lstm", vocab=500)
    x, y = next(models.batches("lstm", 3, model=net, seq_len=20))
    assert x.shape == y.shape == (3, 20) and int(x.max()) < 500
    assert torch.equal(x[:, 1:], y[:, :-1])
