"""``birdnet bench tta`` (time to target): the report's arithmetic (target detection on a curve,
speed-ups, the compute-only limit, the identical-parameters check), the variants it accepts, and a
smoke run of the real thing (2 daemons on loopback, a few steps of the transformer)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from birdnet.bench.tta import identical, merge_ranks, parse_variants, report, speedup, table, time_to_target

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed (pip install torch) for the tta benchmark")


def curve(losses, every=10, s_per_step=1.0, bytes_per_step=None):
    return [{"step": every * (i + 1), "seconds": every * (i + 1) * s_per_step, "val_loss": v, "train_loss": v,
             "wire_bytes": None if bytes_per_step is None else every * (i + 1) * bytes_per_step,
             "adapter_bytes": None} for i, v in enumerate(losses)]


def row(label, kind, losses, s_per_step, bytes_per_step=None, digests=("a", "a")):
    return {"label": label, "kind": kind, "curve": curve(losses, s_per_step=s_per_step, bytes_per_step=bytes_per_step),
            "median_step_s": s_per_step, "identical": identical(list(digests))}


def test_time_to_target_is_the_first_evaluation_at_or_below_it():
    c = curve([3.0, 2.5, 2.1, 2.2, 2.0])
    assert time_to_target(c, 2.1)["step"] == 30  # equal counts as reached; a later dip does not move it
    assert time_to_target(c, 2.05)["step"] == 50
    assert time_to_target(c, 3.0)["seconds"] == 10.0
    assert time_to_target(c, 1.99) is None


def test_speedup_arithmetic_and_missing_times():
    assert speedup(300.0, 40.0) == pytest.approx(7.5)
    assert speedup(300.0, 300.0) == 1.0
    assert speedup(None, 40.0) is None and speedup(300.0, None) is None and speedup(300.0, 0.0) is None


def test_identical_parameters_check():
    assert identical(["x", "x", "x", "x"])
    assert not identical(["x", "x", "y", "x"])
    assert not identical([])


def test_merge_ranks_takes_the_slowest_rank_and_compares_digests():
    def out(rank, secs, digest, loss):
        return {"rank": rank, "digest": digest, "step_times": [secs / 20] * 20,
                "history": [{"step": 10, "seconds": secs / 2, "train_loss": loss, "val_loss": loss,
                             "wire_bytes": 100 * (rank + 1), "adapter_bytes": None},
                            {"step": 20, "seconds": secs, "train_loss": loss, "val_loss": loss,
                             "wire_bytes": 200 * (rank + 1), "adapter_bytes": None}]}
    m = merge_ranks([out(0, 10.0, "d", 2.0), out(1, 12.0, "d", 2.2)])
    assert [e["seconds"] for e in m["curve"]] == [6.0, 12.0]
    assert m["curve"][1]["val_loss"] == pytest.approx(2.1)
    assert m["curve"][1]["wire_bytes"] == 400 and m["curve"][1]["adapter_bytes"] is None
    assert m["median_step_s"] == pytest.approx(0.6) and m["identical"]
    assert m["step_s"] == [0.6] * 20 and "kernels_seconds" not in m  # every step's slowest rank
    dil = [dict(out(r, 10.0, "d", 2.0), kernels_seconds=k) for r, k in ((0, 1.5), (1, 2.5))]
    assert merge_ranks(dil)["kernels_seconds"] == 2.5  # DiLoCo's wait for the kernels: the longest
    assert not merge_ranks([out(0, 10.0, "d", 2.0), out(1, 10.0, "e", 2.0)])["identical"]


def test_report_target_speedups_limit_and_bytes():
    rows = [row("gloo", "gloo", [3.0, 2.4, 2.1, 2.0], 1.0, bytes_per_step=1000),
            row("marsit", "codec", [3.0, 2.2, 2.03, 2.01], 0.25, bytes_per_step=100),
            row("birdplus", "codec", [3.0, 2.6, 2.5, 2.4], 0.2, bytes_per_step=50, digests=("a", "b")),
            row("solo", "solo", [3.1, 2.6, 2.3, 2.2], 0.1, bytes_per_step=None)]
    target, s = report(rows, None, 40)
    assert target == pytest.approx(2.0 * 1.02)
    g, m, b, solo = rows
    assert g["step_at_target"] == 40 and g["time_to_target_s"] == 40.0 and g["speedup_vs_gloo"] == 1.0
    assert m["step_at_target"] == 30 and m["time_to_target_s"] == pytest.approx(7.5)
    assert m["speedup_vs_gloo"] == pytest.approx(40 / 7.5)
    assert s["compute_limit_s"] == pytest.approx(0.1 * 40)  # solo's s/step x Gloo's steps to target
    assert m["x_limit"] == pytest.approx(7.5 / 4.0)
    assert b["time_to_target_s"] is None and b["speedup_vs_gloo"] is None and b["x_limit"] is None
    assert m["fewer_bytes_per_step_than_gloo"] == pytest.approx(10.0)
    assert m["val_loss_vs_gloo"] == pytest.approx(2.01 / 2.0 - 1)
    assert solo["speedup_vs_gloo"] is None and solo["bytes_per_node"] is None
    text = table(rows, s, 40)
    assert "| birdplus | - |" in text and "| NO |" in text and "compute-only limit 4.0 s" in text
    # an explicit target wins over Gloo's
    target, _ = report(rows, 2.3, 40)
    assert target == 2.3 and rows[3]["step_at_target"] == 30


def test_variants_expand_codecs_and_parse_diloco_keywords():
    vs = parse_variants("gloo,gloo-fp16,codecs,diloco,diloco:sync_every=32:codec=topk:codec.density=0.02,solo:steps=50",
                        "none,birdplus:density=0.01")
    assert [v["label"] for v in vs] == ["gloo", "gloo-fp16", "none", "birdplus:density=0.01", "diloco",
                                        "diloco:sync_every=32:codec=topk:codec.density=0.02", "solo:steps=50"]
    assert vs[3]["codec"] == "birdplus" and vs[3]["params"] == {"density": 0.01}
    assert vs[4]["options"] == {}
    assert vs[5]["options"] == {"sync_every": 32, "codec": "topk", "codec_params": {"density": 0.02}}
    assert vs[6]["steps"] == 50
    vs = parse_variants("diloco:sync_every=[[1,30],16]:outer_lr=0.5,gloo", "none")
    assert vs[0]["options"] == {"sync_every": [[1, 30], 16], "outer_lr": 0.5} and vs[1]["label"] == "gloo"
    for bad in ("glo", "diloco:sync=3", "gloo:x=1", "solo:steps=0", "gloo,gloo"):
        with pytest.raises(SystemExit):
            parse_variants(bad, "none")


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_tta_on_loopback(tmp_path):
    # the real bench, cut down: 2 daemons on loopback, 4 steps of the transformer, Gloo DDP, one
    # per-step codec and DiLoCo with its defaults; every rank's process reaped by rank_results, the
    # daemons by LocalCluster
    out = tmp_path / "tta.json"
    png = tmp_path / "tta.png"
    r = subprocess.run([sys.executable, "-m", "birdnet.bench.tta", "--loopback", "--nodes", "2", "--steps", "4",
                        "--eval-every", "2", "--variants", "gloo,codecs,diloco", "--codecs", "marsit",
                        "--json", str(out), "--plot", str(png), "--variant-timeout", "200"],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {x["label"]: x for x in res["rows"]}
    assert set(rows) == {"gloo", "marsit", "diloco"} and not res["failed"]
    assert [e["step"] for e in rows["gloo"]["curve"]] == [2, 4]
    # DiLoCo: its outer parameters, evaluated and compared (the local ones differ between syncs)
    assert all(r["identical"] for r in rows.values())
    assert "local_val_loss" in rows["diloco"]["curve"][-1]
    # the row keeps DiLoCo's settings as resolved (the defaults of this release; the task's AdamW)
    from birdnet.client.diloco import ADAM_CODEC, ADAM_CODEC_PARAMS, ADAM_OUTER_LR, DEFAULT_SCHEDULE
    st = rows["diloco"]["settings"]
    assert (st["codec"], st["codec_params"], st["outer_lr"]) == (ADAM_CODEC, ADAM_CODEC_PARAMS, ADAM_OUTER_LR)
    assert st["sync_every"] == json.loads(json.dumps(DEFAULT_SCHEDULE)) and "settings" not in rows["marsit"]
    assert rows["marsit"]["bytes_per_node"] > 0 and rows["diloco"]["bytes_per_node"] > 0  # the adapter's count
    assert rows["gloo"]["time_to_target_s"] is not None  # its own final loss x 1.02 is reached
    assert res["summary"]["target"] == pytest.approx(rows["gloo"]["curve"][-1]["val_loss"] * 1.02)
    assert png.stat().st_size > 1000
    assert "| marsit |" in r.stdout


def test_report_combines_the_rows_of_several_runs(tmp_path, capsys):
    from birdnet.bench.tta import main
    meta = {"command": "birdnet bench tta", "task": "lm", "nodes": 4, "rate": "20mbit", "steps": 40, "seed": 0,
            "eval_every": 10, "machine": "2 cores"}
    a = {"meta": meta, "rows": [row("gloo", "gloo", [3.0, 2.4, 2.1, 2.0], 1.0, bytes_per_step=1000),
                                row("solo", "solo", [3.1, 2.6, 2.3, 2.2], 0.1)]}
    b = {"seed": 0, "rows": [row("diloco", "diloco", [3.0, 2.3, 2.02, 2.0], 0.12, bytes_per_step=4),
                             row("gloo", "gloo", [9.0, 9.0, 9.0, 9.0], 9.0)]}  # a label seen twice keeps its first row
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json.partial").write_text(json.dumps(b))
    out = tmp_path / "all.json"
    assert main(["--report", str(tmp_path / "a.json"), str(tmp_path / "b.json.partial"), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["label"]: r for r in res["rows"]}
    assert list(rows) == ["gloo", "solo", "diloco"]
    assert res["summary"]["target"] == pytest.approx(2.04) and rows["gloo"]["time_to_target_s"] == 40.0
    assert rows["diloco"]["step_at_target"] == 30 and rows["diloco"]["speedup_vs_gloo"] == pytest.approx(40 / 3.6)
    assert rows["diloco"]["x_limit"] == pytest.approx(3.6 / 4.0)
    assert rows["diloco"]["fewer_bytes_per_step_than_gloo"] == pytest.approx(250.0)
    assert "| diloco | 3.6 | 30 | 11.11x | 0.90 |" in capsys.readouterr().out


def _acc_rows(gloo_accs, diloco_accs, images=400):
    rows = [row("gloo", "gloo", [1.0, 0.5, 0.3, 0.2, 0.2, 0.2], 1.0),
            row("diloco", "diloco", [1.2, 0.6, 0.35, 0.25, 0.25, 0.25], 0.2)]
    for r, accs in zip(rows, (gloo_accs, diloco_accs)):
        for e, acc in zip(r["curve"], accs):
            e["accuracy"], e["test_images"] = acc, images
    return rows


def test_report_accuracy_columns_for_a_task_measured_by_accuracy():
    # the CNN: accuracy at --steps and the mean of the last 5 evaluations, their differences from
    # Gloo's in points, the time to Gloo's windowed accuracy less half a point, the binomial error
    rows = _acc_rows([0.50, 0.96, 0.95, 0.97, 0.96, 0.96], [0.50, 0.90, 0.956, 0.95, 0.94, 0.95])
    target, s = report(rows, None, 60)
    g, d = rows
    assert g["accuracy_window"] == pytest.approx(0.96) and g["accuracy_window_steps"] == [20, 30, 40, 50, 60]
    assert s["accuracy_target"] == pytest.approx(0.955)
    assert g["step_at_accuracy"] == 20 and g["time_to_accuracy_s"] == 20.0
    assert d["step_at_accuracy"] == 30 and d["time_to_accuracy_s"] == pytest.approx(6.0)
    assert d["accuracy_at_steps"] == 0.95 and d["accuracy_vs_gloo_points"] == pytest.approx(-1.0)
    assert d["accuracy_window"] == pytest.approx(0.9392)
    assert d["accuracy_window_vs_gloo_points"] == pytest.approx(-2.08)
    assert g["accuracy_se_points"] == pytest.approx(100 * (0.96 * 0.04 / 400) ** 0.5)  # 0.98 points
    text = table(rows, s, 60)
    assert "accuracy @60 | vs Gloo (points) | mean of last 5 | vs Gloo (points) | time to accuracy (s) |" in text
    assert "| 95.00% | -1.00 | 93.92% | -2.08 | 6.0 | yes |" in text and "accuracy target 95.50%" in text
    assert "standard error of one evaluation of Gloo's: 0.98 points" in text
    # a task without accuracy (the LM) keeps its table
    lm = [row("gloo", "gloo", [3.0, 2.0], 1.0)]
    _, s2 = report(lm, None, 20)
    assert "accuracy_target" not in s2 and "accuracy" not in table(lm, s2, 20)


def test_seeds_table_pairs_each_seed_with_its_own_gloo():
    from birdnet.bench.tta import seeds_table
    results = []
    for seed, (ga, da) in enumerate([([0.9] + [0.96] * 5, [0.9] + [0.95] * 5),
                                     ([0.9] + [0.98] * 5, [0.9] + [0.98] * 5),
                                     ([0.9] + [0.97] * 5, [0.9] + [0.955] * 5)]):
        rows = _acc_rows(ga, da)
        report(rows, None, 60)
        results.append(_result(seed, rows, task="cnn", steps=60))
    text = seeds_table(results)
    # differences -1.0, 0.0, -1.5 points: mean -0.83, standard error 0.44
    assert "| diloco | 96.17% (95.00-98.00) | -0.83 +- 0.44 | 96.17% (95.00-98.00) | -0.83 +- 0.44 |" in text
    assert "| gloo | 97.00% (96.00-98.00) | +0.00 +- 0.00 | 97.00% (96.00-98.00) | +0.00 +- 0.00 |" in text
    assert seeds_table(results[:1]) is None  # one seed: the per-seed table says it all


def _result(seed, rows, **meta):
    m = {"command": "birdnet bench tta", "task": "lm", "nodes": 4, "rate": "20mbit", "steps": 40, "seed": seed,
         "eval_every": 10, "machine": "2 cores"}
    m.update(meta)
    return {"meta": m, "rows": rows}


def test_reuse_with_rerun_runs_the_named_variants_again(tmp_path):
    from types import SimpleNamespace

    from birdnet.bench.tta import reusable
    f = tmp_path / "old.json"
    rows = [row("gloo", "gloo", [3.0, 2.0], 1.0), row("marsit", "codec", [3.0, 2.1], 0.3),
            row("diloco", "diloco", [3.0, 2.2], 0.1), row("diloco:steps=60", "diloco", [3.0, 2.2], 0.1),
            row("solo", "solo", [3.0, 2.5], 0.1)]
    f.write_text(json.dumps([_result(1, rows), _result(2, rows[:1])]))
    a = SimpleNamespace(reuse=str(f), rerun="", task="lm", nodes=4, steps=40, eval_every=10, loopback=False,
                        rate="20mbit")
    assert set(reusable(a, 1)) == {"gloo", "marsit", "diloco", "diloco:steps=60", "solo"}
    assert set(reusable(a, 2)) == {"gloo"} and reusable(a, 3) == {}
    a.rerun = "diloco"  # a kind: every DiLoCo variant runs again
    assert set(reusable(a, 1)) == {"gloo", "marsit", "solo"}
    a.rerun = "codecs,diloco:steps=60"  # labels and the kind of --codecs
    assert set(reusable(a, 1)) == {"gloo", "diloco", "solo"}
    a.rate = "100mbit"
    with pytest.raises(SystemExit, match="rate: 20mbit there, 100mbit here"):
        reusable(a, 1)


def test_report_makes_one_table_per_seed_and_refuses_other_runs(tmp_path, capsys):
    from birdnet.bench.tta import main
    nodiloco = [_result(s, [row("gloo", "gloo", [3.0, 2.4, 2.1, 2.0 + s / 10], 1.0, bytes_per_step=1000),
                            row("solo", "solo", [3.1, 2.6, 2.3, 2.2], 0.1)]) for s in (1, 2)]
    (tmp_path / "base.json").write_text(json.dumps(nodiloco))
    # DiLoCo measured later, seed by seed, with its own target (no Gloo row in it)
    (tmp_path / "new.json").write_text(json.dumps([_result(s, [row("diloco", "diloco", [3.0, 2.3, 2.0, 1.9], 0.12)])
                                                   for s in (2, 1)]))
    out = tmp_path / "all.json"
    assert main(["--report", str(tmp_path / "base.json"), str(tmp_path / "new.json"), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["meta"]["seed"] for r in res] == [1, 2]
    for r, s in zip(res, (1, 2)):
        assert [x["label"] for x in r["rows"]] == ["gloo", "solo", "diloco"]
        assert r["summary"]["target"] == pytest.approx((2.0 + s / 10) * 1.02)
        assert r["rows"][2]["step_at_target"] == 30
    assert capsys.readouterr().out.count("| diloco |") == 2
    (tmp_path / "other.json").write_text(json.dumps(_result(1, [], rate="100mbit")))
    with pytest.raises(SystemExit, match="rate: 100mbit there, 20mbit"):
        main(["--report", str(tmp_path / "base.json"), str(tmp_path / "other.json")])
