"""``python -m gradsync bench schemes``: a tiny run on 2 loopback ranks (JSON rows), the
``--bandwidth`` list (parsing, validation), the crossover's ratios against numbers computed
here, and one command over two links writing the crossover JSON and PNG."""

from __future__ import annotations

import json
import math

import pytest

from gradsync.apps import models
from gradsync.apps.bench import schemes as bench


def test_bench_schemes_smoke(tmp_path, capsys):
    P, steps = 2, 3
    names = ["ddp", "ddp_powersgd", "topka", "ssfusion_oi"]
    rc = bench.main(["--quick", "--steps", str(steps), "--schemes", ",".join(names),
                     "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert all(n in out for n in names) and "exposed ms" in out and "cpu ms" in out
    data = json.loads((tmp_path / "schemes.json").read_text())
    assert (tmp_path / "schemes.png").stat().st_size > 1000
    rows = {r["scheme"]: r for r in data["rows"]}
    assert list(rows) == names
    assert data["meta"]["link"]["link"] == "loopback" and data["meta"]["quick"] is True
    n = sum(p.numel() for p in models.build("cnn").parameters())
    # torch's DDP all-reduce: every fp32 gradient in the ring, 2(P-1)/P·4n bytes per rank
    assert rows["ddp"]["bytes_per_step"] == 2 * (P - 1) / P * 4 * n
    assert rows["ddp"]["speedup_vs_ddp"] == 1.0
    for name in names[1:]:  # compressed: PowerSGD rank 1 and the 1% sparse schemes
        assert 0 < rows[name]["bytes_per_step"] < rows["ddp"]["bytes_per_step"] / 10, name
    for r in rows.values():
        assert r["measured_steps"] == steps - 2  # --quick: warm-up 1, so steps 0-1 excluded
        assert r["samples_per_s"] > 0 and r["step_ms"] > 0 and r["backward_ms"] >= 0
        assert r["comm_ms"] >= 0 and r["exposed_ms"] >= 0 and 0 <= r["missing_rate"] <= 1
        assert 0 < r["cpu_ms"] < math.inf  # the busiest rank's process CPU per step
        assert math.isfinite(r["final_loss"])
        assert r["samples_per_s"] == pytest.approx(P * 8 / (r["step_ms"] / 1e3))
    assert [run["scheme"] for run in data["meta"]["runs"]] == names
    cross = json.loads((tmp_path / "crossover.json").read_text())  # one link: one column
    assert [r["scheme"] for r in cross["rows"]] == names
    assert cross["rows"][0]["loopback"] == 1.0


@pytest.mark.parametrize("argv", [["--density", "0"], ["--world-size", "0"],
                                  ["--bandwidth", "10mbps"], ["--schemes", "nope"],
                                  ["--repeats", "0"]])
def test_bench_schemes_rejects_bad_arguments(argv, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--quick", "--out", str(tmp_path)])
    assert e.value.code == 2


# ------------------------------------------------------------------------- several links
def test_bandwidth_list_parses_and_validates():
    assert bench.parse_links("loopback,1gbit,100mbit") == ["loopback", "1gbit", "100mbit"]
    assert bench.parse_links(" LOOPBACK , 2.5mbit") == ["loopback", "2.5mbit"]
    assert bench.parse_links("1gbit") == ["1gbit"]
    assert bench.link_rate("100mbit") == 1e8 and bench.link_rate("loopback") == float("inf")
    for bad, msg in (("loopback,,1gbit", "empty"), ("1gbit,1000mbit", "repeats"),
                     ("loopback,Loopback", "repeats"), ("10mbps", "ambiguous|bps|bandwidth"),
                     ("", "empty")):
        with pytest.raises(ValueError, match=msg):
            bench.parse_links(bad)


@pytest.mark.parametrize("argv", [["--bandwidth", "loopback,,1gbit"],
                                  ["--bandwidth", "1gbit,1gbit"],
                                  ["--bandwidth", "loopback,10mbps"],
                                  ["--latency", "5ms"]])
def test_bench_schemes_rejects_bad_link_lists(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--quick", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--bandwidth" in capsys.readouterr().err or "--latency" in argv


def _row(link, scheme, sps, ddp_sps, settled=None, probing=0, settled_bytes=1e5):
    return {"link": link, "scheme": scheme, "samples_per_s": sps,
            "speedup_vs_ddp": sps / ddp_sps, "probing_steps": probing,
            "settled_samples_per_s": sps if settled is None else settled,
            "settled_bytes_per_step": settled_bytes}


def test_crossover_ratios_and_outputs(tmp_path):
    from gradsync.apps.common import write_outputs

    rows = [_row("loopback", "ddp", 100.0, 100.0), _row("loopback", "topka", 50.0, 100.0),
            _row("loopback", "auto", 80.0, 100.0, settled=96.0, probing=40),
            _row("100mbit", "ddp", 10.0, 10.0), _row("100mbit", "topka", 30.0, 10.0),
            _row("100mbit", "auto", 28.5, 10.0)]
    cross = bench.crossover(rows, ["loopback", "100mbit"])
    assert cross["speedup_vs_ddp"]["topka"] == {"loopback": 0.5, "100mbit": 3.0}
    lo, slow = cross["auto"]["loopback"], cross["auto"]["100mbit"]
    assert lo["best_fixed"] == "ddp" and lo["auto_vs_ddp"] == pytest.approx(0.80)
    assert lo["auto_vs_best_fixed"] == pytest.approx(0.80)
    assert lo["auto_settled_vs_ddp"] == pytest.approx(0.96) and lo["auto_probing_steps"] == 40
    assert lo["auto_settled_mb_per_step"] == pytest.approx(0.1)
    assert slow["auto_settled_vs_best_fixed"] == pytest.approx(0.95)
    # a run that ended while probing has no settled figure
    ended = bench.crossover([_row("1gbit", "ddp", 10.0, 10.0),
                             _row("1gbit", "auto", 9.0, 10.0, settled=float("nan"), probing=9)],
                            ["1gbit"])["auto"]["1gbit"]
    assert ended["auto_settled_vs_ddp"] is None and ended["auto_vs_ddp"] == pytest.approx(0.9)
    assert slow["best_fixed"] == "topka" and slow["auto_vs_best_fixed"] == pytest.approx(0.95)
    assert slow["auto_vs_ddp"] == pytest.approx(2.85)
    assert cross["rate_bps"] == {"loopback": float("inf"), "100mbit": 1e8}
    jpath, ppath = write_outputs("crossover", [], tmp_path,
                                 plot=bench._plot_crossover(cross, "t"), meta=cross)
    assert jpath.exists() and ppath.stat().st_size > 1000


def test_crossover_over_repeats_is_the_median_of_same_run_ratios():
    """Three repeats of one link: medians and ranges of the same-run ratios, computed here."""
    runs = [  # (ddp, topka, auto samples/s, auto settled) per repeat
        (100.0, 90.0, 120.0, 120.0), (50.0, 60.0, 40.0, 45.0), (80.0, 72.0, 84.0, 88.0)]
    rows = []
    for k, (d, t, a, settled) in enumerate(runs):
        for r in (_row("1gbit", "ddp", d, d), _row("1gbit", "topka", t, d),
                  _row("1gbit", "auto", a, d, settled=settled, probing=10 * k,
                 settled_bytes=[2.5e6, 1e5, 2e5][k])):
            rows.append({**r, "repeat": k})
    cross = bench.crossover_over_repeats(rows, ["1gbit"])
    assert cross["repeats"] == 3 and len(cross["per_repeat"]) == 3
    # topka/ddp: 0.9, 1.2, 0.9 → median 0.9, range [0.9, 1.2]; auto/ddp: 1.2, 0.8, 1.05
    assert cross["speedup_vs_ddp"]["topka"]["1gbit"] == pytest.approx(0.9)
    assert cross["speedup_range"]["topka"]["1gbit"] == pytest.approx([0.9, 1.2])
    assert cross["speedup_vs_ddp"]["auto"]["1gbit"] == pytest.approx(1.05)
    a = cross["auto"]["1gbit"]
    assert a["best_fixed"] == "ddp"  # fastest fixed scheme in 2 of the 3 repeats
    # auto over the best fixed of each repeat: 120/100, 40/60, 84/80
    assert a["auto_vs_best_fixed"] == pytest.approx(1.05)
    assert a["auto_vs_best_fixed_range"] == pytest.approx([40 / 60, 1.2])
    assert a["auto_settled_vs_ddp"] == pytest.approx(1.1)  # 1.2, 0.9, 1.1
    assert a["auto_probing_steps"] == 10 and a["auto_probing_steps_range"] == [0, 20]
    assert a["auto_settled_mb_per_step"] == pytest.approx(0.2)
    assert a["auto_settled_mb_per_step_range"] == pytest.approx([0.1, 2.5])


def test_bench_schemes_repeats_alternate_the_order(tmp_path, capsys):
    names = ["ddp", "topka"]
    rc = bench.main(["--quick", "--steps", "3", "--schemes", ",".join(names), "--repeats", "2",
                     "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "run 2/2 (reversed order)" in out and "median of 2 runs" in out
    data = json.loads((tmp_path / "schemes.json").read_text())
    assert [(r["repeat"], r["scheme"]) for r in data["rows"]] == [
        (0, "ddp"), (0, "topka"), (1, "ddp"), (1, "topka")]
    runs = data["meta"]["runs"]  # per repeat: the schemes in the order they ran
    assert [[r["scheme"] for r in rep] for rep in runs] == [names, names[::-1]]
    assert data["meta"]["config"]["repeats"] == 2
    cross = json.loads((tmp_path / "crossover.json").read_text())["meta"]["crossover"]
    ratios = [r["speedup_vs_ddp"] for r in data["rows"] if r["scheme"] == "topka"]
    assert cross["speedup_vs_ddp"]["topka"]["loopback"] == pytest.approx(sum(ratios) / 2)
    assert cross["speedup_range"]["topka"]["loopback"] == pytest.approx(sorted(ratios))


def test_default_schemes_include_the_new_ones():
    for name in ("hipress", "espresso", "spardl", "auto"):
        assert name in bench.DEFAULT_SCHEMES


@pytest.mark.slow  # 17 s on a quiet machine, 51 s under load: a benchmark run, not a unit test
def test_bench_schemes_two_links(tmp_path, capsys):
    """One command, two links (shaped when this runs as root, else loopback with a note)."""
    names = ["ddp", "topka", "auto"]
    rc = bench.main(["--quick", "--steps", "3", "--schemes", ",".join(names),
                     "--bandwidth", "loopback,100mbit", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "crossover" in out and "auto/best" in out and "settled/ddp" in out
    assert "settled MB/step" in out
    data = json.loads((tmp_path / "schemes.json").read_text())
    assert [(r["link"], r["scheme"]) for r in data["rows"]] == [
        (k, n) for k in ("loopback", "100mbit") for n in names]
    cross = json.loads((tmp_path / "crossover.json").read_text())
    assert [r["scheme"] for r in cross["rows"]] == names
    for r in cross["rows"]:
        assert set(r) == {"scheme", "loopback", "100mbit"}
    ddp = {r["link"]: r["samples_per_s"] for r in data["rows"] if r["scheme"] == "ddp"}
    for r in data["rows"]:  # the crossover's numbers are the rows' same-run ratios
        by = next(c for c in cross["rows"] if c["scheme"] == r["scheme"])
        assert by[r["link"]] == pytest.approx(r["samples_per_s"] / ddp[r["link"]])
    auto = cross["meta"]["crossover"]["auto"]
    for k in ("loopback", "100mbit"):
        best = max((r for r in data["rows"] if r["link"] == k and r["scheme"] != "auto"),
                   key=lambda r: r["samples_per_s"])
        assert auto[k]["best_fixed"] == best["scheme"]
    assert (tmp_path / "crossover.png").stat().st_size > 1000
    assert (tmp_path / "schemes.png").stat().st_size > 1000
