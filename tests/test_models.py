"""The model zoo and the offline text corpus.

Every zoo model builds deterministically from its seed without touching the global RNG and runs a
forward/backward pass on a tiny batch of its natural data. The small ones do so for real; the
paper-scale ones (hundreds of millions of parameters) on the meta device in CI, and for real
under ``-m slow``. A missing optional dependency fails these tests with the install hint (the
set-up installs ``gradsync[models]``); it is never skipped.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from gradsync.apps import data, models

SMALL = ["cnn", "mlp", "resnet18", "resnet50", "vit", "gpt_tiny", "gpt2_small", "bert_small",
         "lstm"]
LARGE = ["resnet152", "vgg16", "vgg19", "vit_large", "gpt2_large", "bert_large"]


def test_names_cover_the_zoo():
    assert sorted(SMALL + LARGE) == models.names()
    for name in SMALL + LARGE:
        assert models.task(name) in ("image", "causal_lm", "masked_lm")
    with pytest.raises(ValueError, match="unknown model"):
        models.build("resnet9000")


def test_optional_dependencies_installed_and_torch_kept():
    # The set-up installs gradsync[models]; without it this fails with the install hint.
    tvm = models.import_torchvision()
    tf = models.import_transformers()
    assert hasattr(tvm, "resnet152") and hasattr(tf, "GPT2LMHeadModel")
    assert torch.__version__.split("+")[0] == "2.13.0"  # transformers did not pull another torch


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
    expected = {"resnet152": 60_192_808, "vgg16": 138_357_544, "vit_large": 304_326_632,
                "gpt2_large": 774_030_080}
    for name, count in expected.items():
        net = models.reference(name, device="meta")
        assert sum(p.numel() for p in net.parameters()) == count, name
    # The Fashion-MNIST ResNet-152 differs from the published one only in stem and classes.
    fm = sum(p.numel() for p in models.build("resnet152", device="meta").parameters())
    assert fm == 60_192_808 - 3 * 7 * 7 * 64 + 3 * 3 * 64 - 2048 * 990 - 990


def test_missing_dependency_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "transformers" else real(n, *a))
    with pytest.raises(ImportError, match=r"gradsync\[models\]"):
        models.build("gpt2_small")
    monkeypatch.setitem(sys.modules, "torchvision.models", None)
    with pytest.raises(ImportError, match=r"gradsync\[models\]"):
        models.build("resnet50")


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
