"""``bench check``: its ratios, limits, baseline and exit codes, without timing anything (the
timed run is CI's own step, ``make bench-check``; here ``measure`` is replaced)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.apps.bench import check

REPO = Path(__file__).resolve().parents[1]


def _run(ratios: dict[str, float]) -> dict[str, dict[str, float]]:
    return {f: {"ratio": r, "ms": 10.0 * r, "reference_ms": 10.0} for f, r in ratios.items()}


def test_ratio_is_the_median_of_per_repetition_maxima_over_ranks():
    """A repetition's time is its slowest rank's, for the collective and for the dense
    reference alike; the figure is the median over repetitions of their ratio."""
    rank0 = {"f": [(2.0, 1.0), (3.0, 1.0), (9.0, 1.0)]}
    rank1 = {"f": [(1.0, 2.0), (3.0, 3.0), (1.0, 1.0)]}
    got = check._ratios([rank0, rank1])["f"]
    # maxima: (2, 2) → 1, (3, 3) → 1, (9, 1) → 9
    assert got["ratio"] == 1.0
    assert got["ms"] == 3000.0 and got["reference_ms"] == 2000.0


def test_record_keeps_median_and_largest_and_a_figure_fails_only_past_the_tolerance():
    runs = [_run({"a": 1.0, "b": 2.0}), _run({"a": 1.2, "b": 2.2}), _run({"a": 1.1, "b": 1.8})]
    base = check.record(runs, "why not", repeats=5, numel=10)
    assert base["figures"]["a"]["median"] == 1.1 and base["figures"]["a"]["max"] == 1.2
    assert base["why"] == "why not" and base["tolerance"] == check.TOLERANCE
    lim = 1.2 * (1 + check.TOLERANCE)
    assert check.verdicts(_run({"a": lim * 0.999, "b": 2.0}), base) == {"a": True, "b": True}
    assert check.verdicts(_run({"a": lim * 1.001, "b": 2.0}), base) == {"a": False, "b": True}


@pytest.mark.parametrize(("text", "match"), [
    (None, "no baseline"), ("{", "not JSON"), ("[]", "expected"),
    ('{"figures": {}}', "expected"), ('{"figures": {"a": {"max": -1}}}', "expected")])
def test_a_missing_or_malformed_baseline_is_refused_clearly(tmp_path, text, match):
    path = tmp_path / "b.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=match):
        check.load_baseline(path)
    assert check.main(["--baseline", str(path), "--out", str(tmp_path)]) == 2


def _fake(monkeypatch, sequence: list[dict[str, float]]) -> list[int]:
    calls = []

    def measure(repeats, numel=check.NUMEL, seed=0):
        calls.append(repeats)
        return _run(sequence[len(calls) - 1])
    monkeypatch.setattr(check, "measure", measure)
    return calls


def _baseline(tmp_path) -> Path:
    path = tmp_path / "base.json"
    path.write_text(json.dumps(check.record([_run({"a": 1.0, "b": 1.0}),
                                             _run({"a": 1.0, "b": 1.0})], "x", 9, 10)))
    return path


def test_a_figure_that_fails_once_is_measured_again_and_passes(monkeypatch, tmp_path):
    calls = _fake(monkeypatch, [{"a": 2.0, "b": 1.0}, {"a": 1.0, "b": 1.0}])
    assert check.main(["--baseline", str(_baseline(tmp_path)), "--out", str(tmp_path)]) == 0
    assert len(calls) == 2
    out = json.loads((tmp_path / "check.json").read_text())
    assert out["meta"]["failed"] == [] and len(out["meta"]["attempts"]) == 2


def test_a_figure_that_fails_twice_fails_the_check(monkeypatch, tmp_path, capsys):
    calls = _fake(monkeypatch, [{"a": 2.0, "b": 1.0}, {"a": 2.0, "b": 1.0}])
    assert check.main(["--baseline", str(_baseline(tmp_path)), "--out", str(tmp_path)]) == 1
    assert len(calls) == 2
    assert "FAILED" in capsys.readouterr().out
    assert json.loads((tmp_path / "check.json").read_text())["meta"]["failed"] == ["a"]


def test_two_different_figures_failing_once_each_do_not_fail_the_check(monkeypatch, tmp_path):
    """Only a figure that fails in both runs fails: noise that moves around does not."""
    _fake(monkeypatch, [{"a": 2.0, "b": 1.0}, {"a": 1.0, "b": 2.0}])
    assert check.main(["--baseline", str(_baseline(tmp_path)), "--out", str(tmp_path)]) == 0


def test_a_passing_run_is_not_repeated(monkeypatch, tmp_path):
    calls = _fake(monkeypatch, [{"a": 1.1, "b": 0.5}])
    assert check.main(["--baseline", str(_baseline(tmp_path)), "--out", str(tmp_path)]) == 0
    assert len(calls) == 1


def test_record_writes_the_baseline_with_its_reason(monkeypatch, tmp_path):
    _fake(monkeypatch, [{"a": 1.0}, {"a": 1.5}, {"a": 1.2}])
    path = tmp_path / "sub" / "base.json"
    assert check.main(["--record", "3", "--why", "faster merge", "--baseline", str(path),
                       "--out", str(tmp_path)]) == 0
    base = check.load_baseline(path)
    assert base["why"] == "faster merge" and base["figures"]["a"]["max"] == 1.5
    assert base["figures"]["a"]["runs"] == [1.0, 1.5, 1.2]


@pytest.mark.parametrize("argv", [["--record", "3"], ["--record", "1", "--why", "x"],
                                  ["--repeats", "2"], ["--record", "2", "--why", " "]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        check.parse_args(argv)


def test_the_repository_baseline_names_every_figure_the_check_measures():
    """The committed baseline and the code agree on the figures (else CI's check exits 2)."""
    base = check.load_baseline(REPO / check.DEFAULT_BASELINE)
    want = {f"collective/{c}@{d:g}" for c in check.COLLECTIVES for d in check.DENSITIES}
    want |= {f"step/{s}" for s in check.SCHEMES}
    assert set(base["figures"]) == want
    assert base["why"].strip() and base["tolerance"] == check.TOLERANCE


def test_a_machine_uses_its_own_baseline_where_one_exists(tmp_path):
    """``<stem>-<cpu slug>.json`` beside the default baseline is this machine's; without one
    the default holds. The repository's per-machine baselines name every figure too."""
    default = tmp_path / "bench-baseline.json"
    assert check.machine_baseline(default, "Intel(R) Xeon(R); AVX512") == default
    own = tmp_path / "bench-baseline-intel-r-xeon-r-avx512.json"
    own.write_text("{}")
    assert check.machine_baseline(default, "Intel(R) Xeon(R); AVX512") == own
    assert check.machine_baseline(default, "AMD EPYC; AVX512") == default
    ci = REPO / check.DEFAULT_BASELINE
    mine = sorted(ci.parent.glob(f"{ci.stem}-*.json"))
    assert mine
    for path in mine:
        base = check.load_baseline(path)
        assert set(base["figures"]) == set(check.load_baseline(ci)["figures"])
        assert base["why"].strip() and base["tolerance"] == check.TOLERANCE
        assert check.machine_baseline(ci, base["cpu"]) == path
