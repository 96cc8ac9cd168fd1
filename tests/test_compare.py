"""`hslite compare`: options, predicted rows and a failing recipe, the files it writes, and a measured comparison."""

from __future__ import annotations

import csv
import json

import pytest
from test_auto_plan import prediction

from hslite.cli import main
from hslite.comparison.measure import _best_single_plan, _entry, _references, _relate, _workload, run_compare
from hslite.comparison.report import median_abs_error, summary_line
from hslite.comparison.rows import CompareOptions, CompareRow, RowSpec, parse_options
from hslite.errors import ConfigError
from hslite.parallel.plan import Plan
from hslite.parallel.trainer.usage import malloc_in_use_bytes
from hslite.parallel.wire_format import wire_bytes
from hslite.preflight_check.decide.verdict import decide
from hslite.recipe.build import build_model, plan_from_config, prepared_datamodule
from hslite.recipe.config import list_recipes, load_config

MEASURED = CompareOptions([], measure=True)  # what a measured comparison asks of its rows' fits

QUICK = ["data.scene=synthetic_tiny", "data.eval_batch_size=128", "preflight.probe_steps=2"]


def fake_check_recipe(cfg):
    """The recipe's plan validated for real, priced at 10 ms a step on one device and 15 ms on several."""
    plan = plan_from_config(cfg)
    single = plan.with_(devices=1, accumulate=plan.dp * plan.accumulate)
    return decide(plan, {single: prediction(single, 0.010), plan: prediction(plan, 0.010 + 0.005 * (plan.dp > 1))})


def test_options_split_compare_keys_from_the_overrides_every_row_gets(tmp_path):
    options = parse_options(["recipes=compare_cpu_*,quickstart", "measure=true", "steps=7", "train.lr=0.01"])
    names = sorted(r for r in list_recipes() if r.startswith("compare_cpu_")) + ["quickstart"]
    assert options.rows == [RowSpec(None, name) for name in names] and len(names) == 8
    assert options.overrides == ["train.lr=0.01"] and options.measure and options.steps == 7 and options.reference
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text("- {label: dp2 b16, recipe: quickstart_cpu2, overrides: [data.batch_size=16]}\n")
    options = parse_options(["recipes=quickstart", f"rows={matrix}", "auto=quickstart", "reference=false"])
    assert options.rows == [
        RowSpec(None, "quickstart"),
        RowSpec("dp2 b16", "quickstart_cpu2", ["data.batch_size=16"]),
        RowSpec(None, "quickstart", ["parallel.plan=auto"]),
    ]
    assert not options.reference and not options.measure
    for bad, message in [
        (["train.lr=0.01"], "needs recipes=A,B,... .* or rows=FILE.yaml"),
        (["recipes=nothing_like_this*"], "no recipe matches"),
        (["recipes=quickstart", "recipe=quickstart"], "not recipe="),
        (["recipes=quickstart", "steps=0"], "steps must be"),
        (["recipes=quickstart", "measure=yes"], "measure must be true or false, got 'yes'"),
        (["recipes=quickstart", "reference=no"], "reference must be true or false, got 'no'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_options(bad)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "does not exist .*check the path"),
        ("- {label: a, recipe: [", "is not valid YAML .*fix it there"),
        ("label: a\nrecipe: quickstart\n", "must be a non-empty YAML list of rows such as .*, got \\{'label'"),
        ("[]", "must be a non-empty YAML list"),
        ("- quickstart\n", "entry 1 is 'quickstart', not a mapping: write it as"),
        ("- {label: a, recipe: quickstart}\n- {label: b, recipe: quickstart, override: [x=1]}\n",
         "entry 2 has unknown key\\(s\\) override: a row takes label, recipe, overrides"),
        ("- {recipe: quickstart}\n", "entry 1 has label None: give it a non-empty text label"),
        ("- {label: a, recipe: 3}\n", "entry 1 \\(a\\) has recipe 3: name a recipe"),
        ("- {label: a, recipe: quickstart, overrides: data.batch_size=8}\n", "entry 1 \\(a\\) has overrides 'data"),
        ("- {label: a, recipe: quickstart, overrides: [batch]}\n", "list of key=value texts"),
    ],
)  # fmt: skip
def test_a_rows_file_mistake_is_one_sentence_naming_the_file_and_the_entry(tmp_path, text, message):
    path = tmp_path / "rows.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        parse_options([f"rows={path}"])
    assert str(caught.value).startswith(f"rows file {path}")
    assert str(caught.value).count(". ") == 0 and str(caught.value).endswith(".")  # one sentence


def test_labels_are_unique_and_a_rows_own_overrides_follow_the_shared_ones(tmp_path, monkeypatch, capsys):
    from hslite.recipe import gate

    monkeypatch.setattr(gate, "check_recipe", fake_check_recipe)
    for rows, named in [
        ([RowSpec("same", "quickstart"), RowSpec("same", "quickstart_cpu2")], "labelled 'same'"),
        ([RowSpec(None, "quickstart"), RowSpec("quickstart", "quickstart")], "labelled 'quickstart'"),  # its name
        ([RowSpec("x (reference)", "quickstart")], "rename it"),
    ]:
        with pytest.raises(ConfigError, match=named):
            run_compare(CompareOptions(rows, [f"output.root={tmp_path}"]))
    assert not (tmp_path / "compare").exists()  # refused before any work
    with pytest.raises(ConfigError, match="row 'typo': unknown key 'data.batchsize'"):
        run_compare(CompareOptions([RowSpec("typo", "quickstart", ["data.batchsize=8"])]))

    matrix = tmp_path / "matrix.yaml"
    matrix.write_text("- {label: one b32, recipe: quickstart, overrides: [data.batch_size=32]}\n"
                      "- {label: dp2 b16, recipe: quickstart_cpu2, overrides: [data.batch_size=16]}\n")  # fmt: skip
    # the shared data.batch_size=8 comes first, so each row's own batch wins
    assert main(["compare", f"rows={matrix}", "data.batch_size=8", f"output.root={tmp_path}", "--json"]) == 0
    one, dp2 = json.loads(capsys.readouterr().out)["rows"]
    assert (one["label"], one["plan"]) == ("one b32", "1×cpu dp1 b32 acc1 32-true")
    assert (dp2["label"], dp2["plan"]) == ("dp2 b16", "2×cpu dp2 b16 acc1 32-true")


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


def test_measured_efficiency_is_against_the_best_measured_single_device_of_the_same_work():
    rows = [
        CompareRow("a", world_size=1, measured_ecd=80.0, error=-0.3),
        CompareRow("b", world_size=1, measured_ecd=100.0, error=0.1),
        CompareRow("c", world_size=2, measured_ecd=60.0, error=0.5),
        CompareRow("d", failure="it broke"),
        CompareRow("vit", world_size=1, measured_ecd=500.0),  # another model: another reference
        CompareRow("vit dp2", world_size=2, measured_ecd=100.0),
    ]
    _relate(rows, ["cnn", "cnn", "cnn", None, "vit", "vit"])
    assert [row.measured_efficiency for row in rows] == [0.8, 1.0, 0.6, None, 1.0, 0.2]
    assert [row.reference for row in rows] == ["b", "b", "b", None, "vit", "vit"]
    assert median_abs_error(rows) == pytest.approx(0.3)
    assert median_abs_error(rows[3:4]) is None


def _report(plan, decision, step_seconds, measured_seconds, min_efficiency=0.5, best_single=None):
    """A made-up preflight.json of a finished run: its verdict, prediction and measured step."""
    return {"requested_plan": plan.to_dict(), "decision": decision, "efficiency": 0.6, "min_efficiency": min_efficiency,
            "best_single": best_single, "requested_prediction": prediction(plan, step_seconds).to_dict(),
            "measured": {"step_seconds": measured_seconds,
                         "relative_error": (step_seconds - measured_seconds) / measured_seconds}}  # fmt: skip


def _measured_row(label, report, oa=None):
    row = CompareRow(label)
    row.add_prediction(report)
    row.add_measurement(report, {"usage": {}, "plan_that_ran": "", "OA": oa}, whole=oa is not None)
    return row


def test_a_channel_group_row_is_adopted_only_when_over_5_percent_faster_than_plain_dp_at_unchanged_accuracy():
    from hslite.comparison.chag_rule import judge_channel_groups

    chag, dp = Plan(devices=4, chag=2, batch_size=32), Plan(devices=4, batch_size=16)  # both 64 samples a step
    cases = {  # (chag row's measured step, its OA, DP's OA) -> the rule's first word
        (0.0090, 0.90, 0.90): "adopt:",  # 10 % faster, same accuracy
        (0.0097, 0.90, 0.90): "reject:",  # 3 % faster: not worth a second communicator
        (0.0090, 0.85, 0.90): "reject:",  # faster, but 5 points of OA lost
        (0.0090, None, None): "faster:",  # short fits: accuracy not checked
        (0.0120, 0.90, 0.90): "reject: step 20.0% slower than dp",  # slower than plain DP
    }
    for (seconds, oa, dp_oa), verdict in cases.items():
        rows = [_measured_row("dp", _report(dp, "GO", 0.01, 0.010), dp_oa),
                _measured_row("chag", _report(chag, "GO", 0.01, seconds), oa)]  # fmt: skip
        judge_channel_groups(rows, ["w", "w"])
        assert rows[1].chag_rule.startswith(verdict), rows[1].chag_rule
        assert rows[1].plain_dp == "dp" and rows[1].step_gain == pytest.approx(1 - seconds / 0.010)
        assert rows[0].chag_rule is None  # plain DP is not judged
    lonely = [_measured_row("chag", _report(chag, "GO", 0.01, 0.009))]
    judge_channel_groups(lonely, ["w"])
    assert lonely[0].chag_rule == "not judged: no measured plain-DP row of its work; add 4×cpu dp4 b16 acc1 32-true"
    other_work = [
        _measured_row("dp", _report(dp, "GO", 0.01, 0.01)),
        _measured_row("chag", _report(chag, "GO", 0.01, 0.009)),
    ]
    judge_channel_groups(other_work, ["cnn", "vit"])
    assert other_work[1].chag_rule.startswith("not judged")


def test_accuracy_trains_every_row_to_the_end_and_needs_measure():
    from hslite.comparison.measure import SHORT_OVERRIDES, run_overrides

    options = parse_options(["recipes=quickstart", "measure=true", "accuracy=true"])
    assert options.accuracy and not set(SHORT_OVERRIDES) & set(run_overrides(options))
    assert set(SHORT_OVERRIDES) <= set(run_overrides(parse_options(["recipes=quickstart", "measure=true"])))
    with pytest.raises(ConfigError, match="accuracy=true .* needs measure=true"):
        parse_options(["recipes=quickstart", "accuracy=true"])


def test_a_verdict_holds_when_go_and_the_measured_efficiency_fall_on_the_same_side_of_its_threshold():
    single, dp2 = Plan(batch_size=64), Plan(devices=2, batch_size=32)
    one = _measured_row("one", _report(single, "GO", 0.010, 0.010))  # ECD 6400
    # dp2 measured at 16 ms a step of 64: ECD 2000, E 0.3125; at 8 ms: ECD 4000, E 0.625
    cases = [("GO", 0.016), ("NO-GO", 0.016), ("GO", 0.008), ("NO-GO", 0.008)]
    rows = [one] + [
        _measured_row(f"{decision} {seconds}", _report(dp2, decision, 0.01, seconds)) for decision, seconds in cases
    ]
    rows.append(_measured_row("undecided", _report(dp2, "UNDECIDED", 0.01, 0.008)))
    rows.append(_measured_row("stricter", _report(dp2, "GO", 0.01, 0.008, min_efficiency=0.7)))  # 0.625 < 0.7
    _relate(rows, ["w"] * len(rows))
    assert [row.measured_efficiency for row in rows[1:5]] == pytest.approx([0.3125, 0.3125, 0.625, 0.625])
    assert [row.verdict_holds for row in rows] == [None, False, True, True, False, None, False]
    assert summary_line(rows).endswith("; verdict held on 2 of 5 multi-device rows (GO iff measured E ≥ 0.5/0.7)")
    unmeasured = _measured_row("crashed", _report(dp2, "GO", 0.01, 0.008))
    _relate([unmeasured], [None])  # no one-device row of its work was measured: nothing to judge
    assert unmeasured.measured_efficiency is None and unmeasured.verdict_holds is None
    assert summary_line([one, unmeasured]).endswith("no multi-device row's verdict could be checked")


def test_a_multi_device_row_gets_a_reference_row_for_its_verdicts_best_single_device_plan(tmp_path):
    best = Plan(batch_size=32, accumulate=2, precision="bf16-mixed")  # what each made-up verdict names
    dp2 = _entry("dp2", "quickstart", ["parallel.devices=2", "data.batch_size=32"], MEASURED)
    dp4 = _entry("dp4", "quickstart", ["parallel.devices=4", "data.batch_size=16"], MEASURED)  # same work as dp2
    vit = _entry("vit dp2", "quickstart", [*dp2.overrides, "model.name=channel_vit"], MEASURED)
    auto = _entry(None, "quickstart", [*dp2.overrides, "train.lr=0.01", "parallel.plan=auto"], MEASURED)
    assert _workload(dp2.cfg) == _workload(dp4.cfg) != _workload(vit.cfg)
    vit_rotating = _entry("vit rot2", "quickstart", [*vit.overrides, "parallel.rotation_groups=2"], MEASURED)
    assert _workload(vit_rotating.cfg) != _workload(vit.cfg)  # a rotating row trains less per step: not one reference
    rows = []
    for entry in (dp2, dp4, vit, auto):
        report = _report(plan_from_config(entry.cfg), "NO-GO", 0.01, 0.02, best_single=best.describe())
        (tmp_path / entry.label).mkdir()
        (tmp_path / entry.label / "preflight.json").write_text(json.dumps(report))
        rows.append(_measured_row(entry.label, report))
        rows[-1].run_dir = entry.label
    assert _best_single_plan(report) == best
    added = _references([dp2, dp4, vit, auto], rows, tmp_path, MEASURED)
    assert [entry.label for entry in added] == [
        "dp2 (reference)",
        "vit dp2 (reference)",
        "quickstart (auto) (reference)",
    ]
    for entry, model in zip(added, ("cnn3d", "channel_vit", "cnn3d"), strict=True):
        assert plan_from_config(entry.cfg) == best and entry.cfg.model.name == model
        assert entry.cfg.parallel.plan == "manual" and entry.cfg.preflight.enforce is False  # measured as it is
    assert added[2].cfg.train.lr == 0.01

    one = _entry("one", "quickstart", ["data.batch_size=32", "parallel.accumulate=2", "parallel.precision=bf16-mixed"],
                 MEASURED)  # fmt: skip
    assert (
        _references([one, dp2], [_measured_row("one", _report(best, "GO", 0.01, 0.01)), rows[0]], tmp_path, MEASURED)
        == []
    )
    unmeasured = CompareRow("dp2", world_size=2, best_single=best.describe(), failure="crashed")
    assert _references([dp2], [unmeasured], tmp_path, MEASURED) == []


def test_a_measured_row_reads_the_run_and_labels_its_bytes():
    plan = Plan(devices=2, batch_size=32, compression="int8")
    report = _report(plan, "NO-GO", 0.02, 0.025)
    usage = {"peak_memory_bytes": 5 * 2**20, "peak_memory_method": "malloc", "counted_bytes_per_step": 1e5}
    row = CompareRow("int8")
    row.add_prediction(report)
    row.add_measurement(report, {"usage": {**usage, "computed_bytes_per_step": 0.0}, "plan_that_ran": ""})
    assert (row.measured_samples_per_second, row.measured_ecd, row.error) == pytest.approx(
        (64 / 0.025, 32 / 0.025, -0.2)
    )
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
    matrix = tmp_path / "rows.yaml"  # one recipe, two layouts: the rows differ only in their overrides
    dp2 = "[parallel.devices=2, data.batch_size=32]"
    matrix.write_text(f"- {{label: one, recipe: quickstart}}\n- {{label: dp2, recipe: quickstart, overrides: {dp2}}}\n")
    code = main(["compare", f"rows={matrix}", "measure=true", "steps=3", *QUICK, f"output.root={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0, out
    (folder,) = (tmp_path / "compare").iterdir()
    rows = json.loads((folder / "compare.json").read_text())["rows"]
    one, two, *reference = rows
    for row in rows:
        assert row["failure"] is None and row["measured_step_seconds"] > 0
        assert row["error"] == pytest.approx((row["predicted_step_seconds"] - row["measured_step_seconds"]) /
                                             row["measured_step_seconds"])  # fmt: skip
        assert row["measured_memory_bytes"] > 0 and (folder / row["run_dir"] / "metrics.json").is_file()
    assert one["comm_bytes_per_step"] is None and one["verdict_holds"] is None  # one process: nothing sent, GO by rule
    assert two["measured_ecd"] == pytest.approx(64 / two["measured_step_seconds"] / 2)
    # dp2's verdict priced its E against a best single-device plan: `one`, or a reference row that fitted it.
    if two["best_single"] == one["plan"]:
        assert reference == []
    else:
        assert [(r["label"], r["plan"]) for r in reference] == [("dp2 (reference)", two["best_single"])]
    best = max((r for r in rows if r["world_size"] == 1), key=lambda r: r["measured_ecd"])
    assert two["reference"] == best["label"] and best["measured_efficiency"] == 1.0
    assert two["measured_efficiency"] == pytest.approx(two["measured_ecd"] / best["measured_ecd"])
    assert two["decision"] in ("GO", "NO-GO") and two["min_efficiency"] == 0.5
    assert two["verdict_holds"] == ((two["decision"] == "GO") == (two["measured_efficiency"] >= 0.5))
    assert f"verdict held on {int(two['verdict_holds'])} of 1 multi-device rows (GO iff measured E ≥ 0.5)" in out
    metrics = json.loads((folder / two["run_dir"] / "metrics.json").read_text())
    assert metrics["plan"]["devices"] == 2 and not (folder / two["run_dir"] / "checkpoints").exists()
    # Plain DDP all-reduces its fp32 gradients once per optimiser step: the ring formula, labelled as computed.
    cfg = load_config("quickstart", [*QUICK, "parallel.devices=2", "data.batch_size=32"])  # the dp2 row's model
    params = sum(p.numel() for p in build_model(cfg, prepared_datamodule(cfg)).parameters())
    assert two["comm_bytes_source"] == "computed" and two["comm_bytes_per_step"] == wire_bytes(params, 2, "none")


def test_a_verdicts_reference_is_found_among_every_layout_the_preflight_prices():
    from hslite.comparison.measure import _best_single_plan
    from hslite.parallel.plan import Plan

    requested = Plan(devices=8, accelerator="gpu", batch_size=64)
    # where no single device fits, the reference may be the fewest devices at a micro-batch of one (down_to_one)
    reference = Plan(devices=2, accelerator="gpu", batch_size=1, accumulate=256, fsdp=True)
    report = {"requested_plan": requested.to_dict(), "best_single": reference.describe()}
    assert _best_single_plan(report) == reference
