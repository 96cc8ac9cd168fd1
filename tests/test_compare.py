"""`hslite compare`: options, predicted rows and a failing recipe, the files it writes, and a measured comparison."""

from __future__ import annotations

import csv
import json

import pytest
from test_auto_plan import prediction

from hslite.cli import main
from hslite.compare.measure import CompareRow, _relate, parse_options
from hslite.compare.report import median_abs_error
from hslite.errors import ConfigError
from hslite.parallel.plan import Plan
from hslite.parallel.usage import malloc_in_use_bytes
from hslite.parallel.wire_format import wire_bytes
from hslite.preflight.verdict import decide
from hslite.recipe.build import build_model, plan_from_config, prepared_datamodule
from hslite.recipe.config import list_recipes, load_config

QUICK = ["data.scene=synthetic_tiny", "data.eval_batch_size=128", "preflight.probe_steps=2"]


def fake_check_recipe(cfg):
    """The recipe's plan validated for real, priced at 10 ms a step on one device and 15 ms on several."""
    plan = plan_from_config(cfg)
    single = plan.with_(devices=1, accumulate=plan.dp * plan.accumulate)
    return decide(plan, {single: prediction(single, 0.010), plan: prediction(plan, 0.010 + 0.005 * (plan.dp > 1))})


def test_options_split_compare_keys_from_the_overrides_every_recipe_gets():
    options = parse_options(["recipes=compare_cpu_*,quickstart", "measure=true", "steps=7", "train.lr=0.01"])
    assert options.recipes == sorted(r for r in list_recipes() if r.startswith("compare_cpu_")) + ["quickstart"]
    assert len(options.recipes) == 8 and options.overrides == ["train.lr=0.01"]
    assert options.measure and options.steps == 7 and options.auto is None
    assert parse_options(["recipes=quickstart", "auto=quickstart"]).auto == "quickstart"
    for bad, message in [
        (["train.lr=0.01"], "needs recipes="),
        (["recipes=nothing_like_this*"], "no recipe matches"),
        (["recipes=quickstart", "recipe=quickstart"], "not recipe="),
        (["recipes=quickstart", "steps=0"], "steps must be"),
        (["recipes=quickstart", "measure=yes"], "measure must be"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_options(bad)


def test_predicted_comparison_writes_csv_json_png_and_keeps_a_failing_recipe_as_a_row(tmp_path, monkeypatch, capsys):
    from hslite.recipe import gate

    monkeypatch.setattr(gate, "check_recipe", fake_check_recipe)
    broken = tmp_path / "broken.yaml"  # valid keys, a layout the plan refuses: 3 ranks cannot form chag groups of 2
    broken.write_text("parallel:\n  accelerator: cpu\n  devices: 3\n  chag: 2\n")
    code = main(["compare", f"recipes=quickstart,quickstart_cpu2,{broken}", f"output.root={tmp_path}", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1  # a failed row makes the exit code say so; the others are still there
    ok, ddp, failed = report["rows"]
    assert ok["plan"] == "1×cpu dp1 b64 acc1 32-true" and ok["predicted_step_seconds"] == pytest.approx(0.010)
    assert ddp["plan"] == "2×cpu dp2 b32 acc1 32-true" and ddp["predicted_efficiency"] == pytest.approx(10 / 15 / 2)
    assert ddp["decision"] == "NO-GO" and ok["decision"] == "GO"
    assert failed["failure"].startswith("invalid parallel plan") and "chag(2)" in failed["failure"]
    assert report["median_abs_error"] is None  # nothing was measured

    folder = tmp_path / "compare" / report["folder"].rsplit("/", 1)[-1]
    assert json.loads((folder / "compare.json").read_text())["rows"] == report["rows"]
    with (folder / "compare.csv").open() as table:
        written = list(csv.DictReader(table))
    assert [row["label"] for row in written] == ["quickstart", "quickstart_cpu2", "broken"]
    assert float(written[1]["predicted_ecd"]) == pytest.approx(64 / 0.015 / 2)
    import matplotlib.image

    assert (folder / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(folder / "compare.png").shape[1] >= 1000  # two panels side by side

    assert main(["compare", "recipes=quickstart,quickstart_cpu2", f"output.root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "1×cpu dp1 b64 acc1 32-true" in out and "median prediction error" not in out and "compare.png" in out


def test_measured_efficiency_is_against_the_best_measured_single_device_and_the_median_error_over_measured_rows():
    rows = [
        CompareRow("a", world_size=1, measured_ecd=80.0, error=-0.3),
        CompareRow("b", world_size=1, measured_ecd=100.0, error=0.1),
        CompareRow("c", world_size=2, measured_ecd=60.0, error=0.5),
        CompareRow("d", failure="it broke"),
    ]
    _relate(rows)
    assert [row.measured_efficiency for row in rows] == [0.8, 1.0, 0.6, None]
    assert median_abs_error(rows) == pytest.approx(0.3)
    assert median_abs_error(rows[3:]) is None


def test_a_measured_row_reads_the_run_and_labels_its_bytes():
    plan = Plan(devices=2, batch_size=32, compression="int8")
    report = {"requested_plan": plan.to_dict(), "decision": "NO-GO", "efficiency": 0.4,
              "requested_prediction": prediction(plan, 0.02).to_dict(),
              "measured": {"step_seconds": 0.025, "relative_error": -0.2}}  # fmt: skip
    usage = {"peak_memory_bytes": 5 * 2**20, "peak_memory_method": "malloc", "counted_bytes_per_step": 1e5}
    row = CompareRow("int8")
    row.add_prediction(report)
    row.add_measurement(report, {"usage": {**usage, "computed_bytes_per_step": 0.0}, "plan_that_ran": ""})
    assert (row.measured_samples_per_second, row.measured_ecd, row.error) == (64 / 0.025, 32 / 0.025, -0.2)
    assert (row.comm_bytes_per_step, row.comm_bytes_source, row.measured_memory_bytes) == (1e5, "counted", 5 * 2**20)
    changed = CompareRow("guarded")
    changed.add_measurement({**report, "measured": None}, {"plan_that_ran": "2×cpu dp2 b32 acc1 32-true bf16"})
    assert changed.measured_step_seconds is None and "ended as 2×cpu dp2 b32 acc1 32-true bf16" in changed.failure


def test_cpu_memory_is_what_malloc_has_handed_out_and_not_taken_back():
    import torch

    before = malloc_in_use_bytes()
    if before is None:
        pytest.skip("glibc ≥ 2.33 (mallinfo2) is needed to measure CPU memory")
    block = torch.ones(4 * 2**20 // 4)  # 4 MiB
    grown = malloc_in_use_bytes() - before
    del block
    assert 4 * 2**20 <= grown < 5 * 2**20 and malloc_in_use_bytes() - before < 2**20


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_measured_comparison_of_one_and_two_processes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the runs' own pre-flights measure afresh
    code = main(["compare", "recipes=quickstart,quickstart_cpu2", "measure=true", "steps=3", *QUICK,
                 f"output.root={tmp_path}"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "median prediction error:" in out
    (folder,) = (tmp_path / "compare").iterdir()
    one, two = json.loads((folder / "compare.json").read_text())["rows"]
    for row in (one, two):
        assert row["failure"] is None and row["measured_step_seconds"] > 0
        assert row["error"] == pytest.approx((row["predicted_step_seconds"] - row["measured_step_seconds"]) /
                                             row["measured_step_seconds"])  # fmt: skip
        assert row["measured_memory_bytes"] > 0 and (folder / row["run_dir"] / "metrics.json").is_file()
    assert one["measured_efficiency"] == 1.0 and one["comm_bytes_per_step"] is None  # one process sends nothing
    assert two["measured_ecd"] == pytest.approx(64 / two["measured_step_seconds"] / 2)
    metrics = json.loads((folder / two["run_dir"] / "metrics.json").read_text())
    assert metrics["plan"]["devices"] == 2 and not (folder / two["run_dir"] / "checkpoints").exists()
    # Plain DDP all-reduces its fp32 gradients once per optimiser step: the ring formula, labelled as computed.
    cfg = load_config("quickstart_cpu2", QUICK)
    params = sum(p.numel() for p in build_model(cfg, prepared_datamodule(cfg)).parameters())
    assert two["comm_bytes_source"] == "computed" and two["comm_bytes_per_step"] == wire_bytes(params, 2, "none")
