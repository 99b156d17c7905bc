"""Hostile wire data at scale: every decoder fed random, truncated and bit-flipped buffers.

Decoders: ``coo.decode``, ``densestream.decode``, ``sketch.unpack_index``/``unpack_counts``
and ``CountSketch.peel`` (its sketch and mask inputs). Every call must either

* return a well-formed result — for the byte formats a SparseGrad with int64, strictly
  increasing, in-range indices, no more entries than the buffer can hold, and which re-encodes
  to the very same bytes (the decoders accept only canonical encodings); for the index, a mask
  that packs back to the same bytes; for peel, values that are zero outside the mask — or
* raise ``ValueError``.

Anything else (another exception, a crash) fails. Each call runs under a wall-clock alarm (no
hang) and the whole campaign under an address-space limit (``RLIMIT_AS`` = the process's size
now + 512 MiB), so a decoder that trusted a hostile length and tried to allocate for it fails
with an allocation error instead of passing. Inputs come from a seeded ``numpy`` generator:
random bytes (half of them behind a valid header, to get past the magic check), and mutations
of valid encodings (truncation, extension, bit flips, interesting bytes, header fields set to
interesting int64 values, splices).

``make test`` runs a few thousand cases per decoder; the ``slow`` campaign a few hundred
thousand in total and prints its counts and time.
"""

from __future__ import annotations

import contextlib
import resource
import signal
import struct
import time
from collections import Counter

import numpy as np
import pytest
import torch

from gradsync.formats import coo, densestream
from gradsync.formats.sketch import CountSketch, pack_index, unpack_counts, unpack_index
from gradsync.sparsegrad import SparseGrad

CALL_LIMIT_S = 10.0  # the alarm: a call running this long counts as a hang
AS_HEADROOM = 512 * 2**20  # address space a campaign may add to the process
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTERESTING_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF]
INTERESTING_I64 = [0, 1, -1, 2, 7, 255, 2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1,
                   -(2**63), -(2**31)]


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang(f"call exceeded {CALL_LIMIT_S}s")


@contextlib.contextmanager
def _address_space_limit():
    """Lower the soft RLIMIT_AS to (current size + headroom) for the block; restore after."""
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + AS_HEADROOM
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _timed(fn, *args, **kwargs):
    """(result or exception, seconds); the alarm turns a hang into ``_Hang``."""
    signal.setitimer(signal.ITIMER_REAL, CALL_LIMIT_S)
    t0 = time.perf_counter()
    try:
        out = fn(*args, **kwargs)
    except ValueError as e:
        out = e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return out, time.perf_counter() - t0


# -- inputs -----------------------------------------------------------------------------------
def _valid_selection(rng: np.random.Generator) -> tuple[SparseGrad, int]:
    numel = int(rng.choice([1, 2, 5, 17, 100, 1000, 70_000]))
    nnz = int(rng.integers(0, min(numel, 64) + 1))
    if rng.random() < 0.3 and nnz > 1:  # clustered: long DenseStream blocks
        start = int(rng.integers(0, numel - nnz + 1))
        idx = np.arange(start, start + nnz)
        idx = idx[rng.random(nnz) < 0.8]
    else:
        idx = np.sort(rng.choice(numel, size=nnz, replace=False))
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    vals = torch.tensor(rng.standard_normal(len(idx)).tolist(), dtype=torch.float64).to(dtype)
    vals[vals == 0] = 1.0
    iw = 4 if rng.random() < 0.7 else 8
    # fresh tensors (not from_numpy: an empty numpy array has stride 0, which coo.encode
    # rejects — see test_coo_encode_empty_selection_with_stride_0)
    return SparseGrad(torch.tensor(idx.tolist(), dtype=torch.int64), vals, numel), iw


def _random_buffer(rng: np.random.Generator, magic: bytes, n_fields: int) -> bytes:
    body = rng.integers(0, 256, int(rng.integers(0, 160)), dtype=np.uint8).tobytes()
    if rng.random() < 0.5:
        return body
    # a plausible header: valid magic/version/width/code, small random fields
    iw = int(rng.choice([4, 8]))
    code = int(rng.integers(1, 5))
    fields = [int(rng.integers(0, 40)) for _ in range(n_fields)]
    return struct.pack("<4sBBBB" + "q" * n_fields, magic, 1, iw, code, 0, *fields) + body


def _mutate(rng: np.random.Generator, raw: bytes, n_fields: int) -> bytes:
    b = bytearray(raw)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(7))
        if op == 0 and b:  # truncate
            b = b[: int(rng.integers(0, len(b)))]
        elif op == 1:  # extend
            b += rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
        elif op == 2 and b:  # flip bits
            for _ in range(int(rng.integers(1, 9))):
                i = int(rng.integers(len(b)))
                b[i] ^= 1 << int(rng.integers(8))
        elif op == 3 and b:  # an interesting byte
            b[int(rng.integers(len(b)))] = int(rng.choice(INTERESTING_BYTES))
        elif op == 4 and len(b) >= 8 + 8 * n_fields:  # a header field to an extreme
            f = int(rng.integers(n_fields))
            v = int(rng.choice([*INTERESTING_I64, len(b), len(b) // 2, len(b) - 1]))
            b[8 + 8 * f: 16 + 8 * f] = struct.pack("<q", v)
        elif op == 5 and len(b) > 8:  # splice: duplicate or drop a chunk of the body
            i, j = sorted(int(x) for x in rng.integers(8, len(b), 2))
            b = b[:j] + b[i:j] + b[j:] if rng.random() < 0.5 else b[:i] + b[j:]
        elif op == 6 and len(b) >= 8:  # header bytes 4..7: version, width, code, reserved
            b[4 + int(rng.integers(4))] = int(rng.integers(256))
    return bytes(b)


# -- per-decoder checks -------------------------------------------------------------------------
def _check_sparse(fmt, raw: bytes, out: SparseGrad) -> None:
    idx = out.indices
    assert idx.dtype == torch.int64 and idx.dim() == 1 and out.values.numel() == idx.numel()
    assert idx.numel() <= len(raw)  # never more entries than the bytes could carry
    if idx.numel():
        assert int(idx[0]) >= 0 and int(idx[-1]) < out.numel
        assert bool((idx[1:] > idx[:-1]).all())
    iw = raw[5]
    again = fmt.encode(out, index_bytes=iw)
    assert bytes(again.tolist()) == raw, "accepted a non-canonical buffer"


def _fuzz_format(fmt, n_fields: int, n: int, seed: int, stats: Counter) -> float:
    rng = np.random.default_rng(seed)
    worst = 0.0
    for i in range(n):
        if i % 3 == 0:
            raw = _random_buffer(rng, fmt.MAGIC, n_fields)
        else:
            sel, iw = _valid_selection(rng)
            raw = bytes(fmt.encode(sel, index_bytes=iw).tolist())
            if i % 3 == 2:
                raw = _mutate(rng, raw, n_fields)
        as_tensor = rng.random() < 0.5
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if as_tensor and raw else raw
        out, secs = _timed(fmt.decode, buf)
        worst = max(worst, secs)
        if isinstance(out, ValueError):
            stats["rejected"] += 1
        else:
            stats["accepted"] += 1
            try:
                _check_sparse(fmt, raw, out)
            except AssertionError as e:  # counted and kept: the campaign reports them all
                stats["invalid"] += 1
                stats.setdefault("examples", []).append((raw.hex(), str(e)[:200]))
    return worst


def _fuzz_unpack(n: int, seed: int, stats: Counter) -> float:
    rng = np.random.default_rng(seed)
    worst = 0.0
    for _ in range(n):
        bits = int(rng.choice([1, 1, 4, 4, 0, 2, 8]))
        count = int(rng.choice([0, 1, 7, 8, 9, 100, 1023, 1024, 4097, 2**40, -1]))
        if rng.random() < 0.6 and 0 <= count < 10_000 and bits in (1, 4):
            nb = (count * bits + 7) // 8 + int(rng.choice([0, 0, 0, -1, 1]))
        else:
            nb = int(rng.integers(0, 300))
        raw = rng.integers(0, 256, max(nb, 0), dtype=np.uint8)
        if rng.random() < 0.5 and bits in (1, 4) and count > 0 and nb > 0:
            raw[-1] &= (1 << ((count * bits) % 8 or 8)) - 1  # clean padding: often accepted
        buf = torch.from_numpy(raw)
        r = rng.random()
        if r < 0.05:
            buf = buf.to(torch.int16)
        elif r < 0.1:
            buf = buf.view(1, -1)
        elif r < 0.12:
            buf = raw.tobytes()
        fn = unpack_index if rng.random() < 0.5 else unpack_counts
        out, secs = _timed(fn, buf, count, bits)
        worst = max(worst, secs)
        if isinstance(out, ValueError):
            stats["rejected"] += 1
            continue
        stats["accepted"] += 1
        assert out.dim() == 1 and out.numel() == count
        if fn is unpack_index:
            assert out.dtype == torch.bool
            if bits == 1:
                assert torch.equal(pack_index(out, 1), buf)
        else:
            assert out.dtype == torch.uint8 and (out.numel() == 0 or int(out.max()) < 2**bits)
    return worst


_SKETCHES: dict[tuple[int, int], CountSketch] = {}


def _fuzz_peel(n: int, seed: int, stats: Counter) -> float:
    rng = np.random.default_rng(seed)
    worst = 0.0
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, 1e-45, 0.0])
    for _ in range(n):
        key = (int(rng.choice([1, 700, 1024, 3000, 20_000])), int(rng.choice([2, 4, 10])))
        sk = _SKETCHES.get(key)
        if sk is None:
            sk = _SKETCHES[key] = CountSketch(key[0], key[1], seed=3)
        length = sk.length + int(rng.choice([0, 0, 0, 0, -1, 1, -sk.length]))
        sketch = torch.from_numpy(rng.standard_normal(max(length, 0)).astype(np.float32))
        if rng.random() < 0.2 and sketch.numel():
            sketch[int(rng.integers(sketch.numel()))] = specials[int(rng.integers(6))]
        r = rng.random()
        if r < 0.05:
            sketch = sketch.to(torch.int32)
        elif r < 0.1:
            sketch = sketch.to(torch.float16)
        elif r < 0.13:
            sketch = sketch.view(1, -1)
        m = sk.n + int(rng.choice([0, 0, 0, 0, 1, -1]))
        density = float(rng.choice([0.0, 0.001, 0.02, 0.1, 0.5, 1.0]))
        mask = torch.from_numpy(rng.random(max(m, 0)) < density)
        if rng.random() < 0.05:
            mask = mask.to(torch.uint8)
        how = "raise" if rng.random() < 0.2 else "report"
        try:
            out, secs = _timed(sk.peel, sketch, mask, on_failure=how)
        except RuntimeError as e:  # PeelError with on_failure="raise" is the documented raise
            from gradsync.formats.sketch import PeelError

            if not isinstance(e, PeelError):
                raise
            stats["peel_error"] += 1
            continue
        worst = max(worst, secs)
        if isinstance(out, ValueError):
            stats["rejected"] += 1
            continue
        stats["accepted"] += 1
        values, report = out
        assert values.shape == (sk.n,)
        assert bool((values[~mask] == 0).all())
        assert 0 <= report.unresolved <= int(mask.sum())
        assert report.lossy == (report.unresolved > 0)
    return worst


CAMPAIGNS = {
    "coo.decode": lambda n, seed, st: _fuzz_format(coo, 2, n, seed, st),
    "densestream.decode": lambda n, seed, st: _fuzz_format(densestream, 3, n, seed, st),
    "unpack_index/counts": _fuzz_unpack,
    "CountSketch.peel": _fuzz_peel,
}


def _campaign(sizes: dict[str, int], seed: int) -> dict[str, dict]:
    report: dict[str, dict] = {}
    with _address_space_limit():
        for name, n in sizes.items():
            stats: Counter = Counter()  # outcome -> count ("examples": invalid inputs)
            t0 = time.perf_counter()
            worst = CAMPAIGNS[name](n, seed, stats)
            report[name] = {"cases": n, **stats, "seconds": time.perf_counter() - t0,
                            "worst_call_s": worst}
    return report


def _assert_sane(report: dict[str, dict]) -> None:
    for name, r in report.items():
        done = r.get("accepted", 0) + r.get("rejected", 0) + r.get("peel_error", 0)
        assert done == r["cases"], f"{name}: {r}"
        assert r.get("invalid", 0) == 0, \
            f"{name}: {r['invalid']} malformed results accepted, e.g. {r['examples'][:3]}"
        # both outcomes are exercised: the fuzzer reaches past the validation
        assert r.get("accepted", 0) > 0 and r.get("rejected", 0) > 0, f"{name}: {r}"
        assert r["worst_call_s"] < CALL_LIMIT_S, f"{name}: {r}"


CI_SIZES = {"coo.decode": 3000, "densestream.decode": 1500, "unpack_index/counts": 3000,
            "CountSketch.peel": 300}
SLOW_SIZES = {"coo.decode": 120_000, "densestream.decode": 120_000,
              "unpack_index/counts": 100_000, "CountSketch.peel": 20_000}


def test_fuzz_decoders_ci():
    _assert_sane(_campaign(CI_SIZES, seed=2026))


def test_address_space_limit_catches_a_huge_allocation():
    """The guard works: inside it, a 4 GiB allocation fails (RuntimeError), after it not."""
    with _address_space_limit(), pytest.raises(RuntimeError):
        torch.empty(2**32, dtype=torch.uint8).fill_(1)
    assert resource.getrlimit(resource.RLIMIT_AS)[0] != 0


def test_coo_encode_empty_selection_with_stride_0():
    empty = torch.from_numpy(np.zeros(0, dtype=np.int64))  # numpy gives stride 0
    sel = SparseGrad(empty, torch.zeros(0), 10)
    assert coo.decode(coo.encode(sel)).numel == 10


def test_densestream_zero_blocks_with_values_is_rejected():
    raw = struct.pack("<4sBBBBqqq", densestream.MAGIC, 1, 4, 1, 0, 39, 0, 3)
    raw += struct.pack("<3f", 1.0, 2.0, 3.0)
    with pytest.raises(ValueError):
        densestream.decode(raw)


@pytest.mark.slow
def test_fuzz_decoders_campaign(capsys):
    t0 = time.perf_counter()
    report = _campaign(SLOW_SIZES, seed=7)
    with capsys.disabled():
        total = sum(r["cases"] for r in report.values())
        print(f"\nfuzz campaign: {total} cases in {time.perf_counter() - t0:.1f}s")
        for name, r in report.items():
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                     if k != "examples"}
            print(f"  {name:20s} {shown}")
            for ex in r.get("examples", [])[:3]:
                print(f"      invalid: {ex}")
    _assert_sane(report)
