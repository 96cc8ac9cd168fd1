"""`hslite preflight` as a go/no-go guard and the gate in `hslite fit`: exit codes, reasons, reports."""

import json

import pytest

from hslite.cli import main
from hslite.config import load_config
from hslite.parallel.plan import Plan
from hslite.preflight.check import input_shape
from hslite.preflight.probe import ProbeResult

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test measures afresh into its own cache: no result leaks from a developer's earlier runs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_input_shape_follows_band_removal_and_pca():
    assert input_shape(load_config("quickstart")) == (200, 1, 16)
    assert input_shape(load_config("indian_pines_1gpu")) == (30, 25, 16)
    raw = load_config(None, ["data.scene=indian_pines_raw"])
    assert input_shape(raw)[0] == 200  # 220 bands less the 20 conventional water bands


def test_single_device_plan_is_go(capsys):
    assert main(["preflight", "recipe=quickstart", "preflight.probe_steps=3"]) == 0
    assert "GO" in capsys.readouterr().out


@pytest.mark.distributed
def test_small_model_on_four_processes_is_no_go_with_the_better_plan_named(capsys):
    code = main(["preflight", "recipe=quickstart_cpu4", "--json", "preflight.probe_steps=3"])
    report = json.loads(capsys.readouterr().out)
    assert code == 3 and report["go"] is False and report["exit_code"] == 3
    assert report["best_passing"].startswith("1×cpu")
    assert report["efficiency"] < 0.5
    assert any("efficiency" in reason for reason in report["reasons"])
    assert report["requested_prediction"]["loop_seconds"] > 0  # four ranks' measured Lightning + DDP loop


def test_gpus_not_visible_is_explained_and_topology_still_predicts(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["preflight", "recipe=indian_pines_8gpu"]) == 3
    err = capsys.readouterr().err
    assert "8 GPUs" in err and "preflight.topology=" in err and "nvlink_8" in err
    code = main(["preflight", "recipe=indian_pines_8gpu", "preflight.topology=nvlink_8", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == report["exit_code"] and code in (0, 3)
    assert any("topology profile 'nvlink_8'" in r for r in report["reasons"])
    assert any("stand in for the GPU" in r for r in report["reasons"])
    assert any("one local rank's figure" in r for r in report["reasons"])
    assert {row["plan"] for row in report["rows"]} >= {report["requested"], report["best_single"]}


def test_unknown_topology_is_a_usage_error(capsys):
    assert main(["preflight", "recipe=indian_pines_8gpu", "preflight.topology=nvlink_99"]) == 2
    assert "nvlink_8" in capsys.readouterr().err


def _probe(threads: int, step_seconds: float) -> ProbeResult:
    return ProbeResult(
        forward_seconds=step_seconds / 3, backward_seconds=step_seconds * 2 / 3, optimizer_seconds=1e-4,
        data_seconds=1e-4, batch_size=16, precision="32-true", threads=threads, device="cpu",
        param_count=60_000, param_bytes=240_000, grad_bytes=240_000, optimizer_bytes=480_000,
        activation_bytes=1_000_000, peak_bytes=2_000_000, compute_c0_seconds=step_seconds / 2,
        compute_c1_seconds_per_sample=step_seconds / 32, compress_seconds_per_byte=None,
    )  # fmt: skip


def test_fit_refuses_no_go_with_exit_3_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from hslite.preflight import check
    from hslite.preflight.links import LinkModel

    # A slow link makes the 4-process plan clearly unprofitable whatever this machine's load.
    slow = LinkModel(alpha_seconds=0.01, bandwidth_bytes_per_second=1e6, source="test: a slow link")
    monkeypatch.setattr(check, "measure_links_for", lambda plan, fresh=False: slow)
    monkeypatch.setattr(check, "probe_for_plans", lambda *a, **k: lambda plan: _probe(2 // plan.devices or 1, 0.003))
    code = main(["fit", "recipe=quickstart_cpu4", f"output.root={tmp_path}", "train.progress=false"])
    assert code == 3
    err = capsys.readouterr().err
    assert "NO-GO" in err and "preflight.enforce=false" in err
    assert not (tmp_path / "quickstart_cpu4").exists()


@pytest.mark.slow
def test_fit_saves_preflight_report_with_measured_step_time(tmp_path):
    from hslite.fit import fit

    cfg = load_config("quickstart", [f"output.root={tmp_path}", "train.max_epochs=2", "train.progress=false",
                                     "output.save_map=false", "preflight.probe_steps=3"])  # fmt: skip
    result = fit(cfg)
    report = json.loads((result.run_dir / "preflight.json").read_text())
    assert report["go"] is True and report["requested_plan"] == Plan(accelerator="cpu").to_dict()
    measured = report["measured"]
    assert measured["step_seconds"] > 0 and measured["predicted_step_seconds"] > 0
    assert result.metrics["measured_step_seconds"] == measured["step_seconds"]
