"""GPU device profiles: what-if pricing of GPUs that are not here with compute from a datasheet's roofline."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from torch import nn

from hslite.cli import main
from hslite.errors import ConfigError
from hslite.preflight_check.hardware.device_profile import (
    CONV_EFFICIENCY,
    DEFAULT_LAUNCH_US,
    MATMUL_EFFICIENCY,
    MEMORY_EFFICIENCY,
    DeviceProfile,
    launch_seconds_on,
    list_devices,
    load_device,
)
from hslite.preflight_check.measure.step_counts import count_step
from hslite.preflight_check.measurements import Footprint, ProbeResult, StepCounts
from hslite.preflight_check.price.roofline import copy_added_seconds, profile_probe, roofline_seconds
from hslite.recipe.config import load_config

pytestmark = pytest.mark.timeout(300)
IP8_HERE = ["recipe=indian_pines_8gpu", "data.scene=synthetic_indian_pines"]  # same shapes as Indian Pines, offline
PRICE_ON_H100 = ["preflight.device=h100_sxm", "preflight.topology=nvlink_8", "--json"]
FIGURES = ("memory_gib", "memory_gbps", "fp32_tflops", "bf16_tflops", "host_gbps")
HOST_LOOP_SECONDS, HOST_GATHER_SECONDS = 2e-3, 1e-3


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Counts and probes go to a cache of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def no_gpu_here(monkeypatch):
    """This box has no GPU, whatever box runs the test, and nothing times this CPU's compute for a GPU plan."""
    from hslite.recipe import gate

    def refuse(*args, **kwargs):
        raise AssertionError("the probe timed this CPU for a GPU plan")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gate, "probe_for_plans", refuse)
    # The host work a GPU plan still times on this CPU, stubbed: the loop and the batch gather. What is left (sizes,
    # FLOPs and kernels counted from the model, the profile, the topology) is the same on every box.
    monkeypatch.setattr(
        "hslite.recipe.recipe_parts.measure_step_overhead", lambda plan, classes, fresh=False: HOST_LOOP_SECONDS
    )
    monkeypatch.setattr(gate, "wall_seconds", lambda fn, device: HOST_GATHER_SECONDS)


def test_every_shipped_profile_has_all_figures_each_cited():
    assert {"h100_sxm", "h200", "a100_40gb", "a100_80gb", "l40s", "rtx_4090", "rtx_3090", "mi250x"} <= set(
        list_devices()
    )
    for name in list_devices():
        profile = load_device(name)
        assert all(getattr(profile, figure) > 0 for figure in FIGURES), name
        assert all(profile.source.get(figure) for figure in FIGURES), name
        assert any(cite.startswith("https://") for cite in profile.source.values()), f"{name}: no datasheet URL"
        assert profile.efficiencies == {"matmul": MATMUL_EFFICIENCY, "conv": CONV_EFFICIENCY,
                                        "memory": MEMORY_EFFICIENCY}  # fmt: skip
        assert profile.bf16_tflops > profile.fp32_tflops
    h100, h200 = load_device("h100_sxm"), load_device("h200")
    assert (h100.fp32_tflops, h100.bf16_tflops, h100.memory_gbps) == (66.9, 989.4, 3350.0)  # dense, plain FP32
    assert (h200.fp32_tflops, h200.bf16_tflops) == (h100.fp32_tflops, h100.bf16_tflops) and h200.memory_gbps == 4800
    assert h100.peak_flops("32-true") == pytest.approx(66.9e12)
    assert h100.peak_flops("bf16-mixed") == h100.peak_flops("16-mixed") == pytest.approx(989.4e12)


def test_unknown_device_is_a_config_error_listing_the_profiles():
    with pytest.raises(ConfigError, match="unknown preflight.device 'h100'.*h100_sxm.*rtx_4090"):
        load_device("h100")
    with pytest.raises(ConfigError, match="device_efficiency"):
        load_config(None, ["preflight.device_efficiency=1.5"])


def test_unknown_device_on_the_command_line_exits_2(capsys):
    assert main(["preflight", *IP8_HERE, "preflight.device=h100", "preflight.topology=nvlink_8"]) == 2
    err = capsys.readouterr().err
    assert "unknown preflight.device 'h100'" in err and "h100_sxm" in err and "Traceback" not in err


def test_flops_of_two_linear_layers_forward_and_backward():
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 64), torch.randint(0, 10, (b,))

    counts = count_step(model, make_batch, precision="32-true")
    # Forward 2·in·out per sample and layer. Backward: the input's gradient and the weight's, 2·in·out each, except
    # in the first layer, whose input (the batch) needs none: 3× forward for every layer but the first.
    assert counts.forward_flops_per_sample == 2 * (64 * 256 + 256 * 10)
    assert counts.backward_flops_per_sample == 2 * 64 * 256 + 2 * 2 * 256 * 10
    assert counts.forward_flops_fixed == counts.backward_flops_fixed == 0
    assert counts.forward_flops(32) == 32 * counts.forward_flops_per_sample
    assert counts.forward_kernels >= 3 and counts.backward_kernels >= 3 and counts.optimizer_kernels >= 1
    assert counts.input_bytes_per_sample == 64 * 4 + 8  # fp32 features, int64 label
    assert counts.model == "Sequential"


def _profile(**figures: float) -> DeviceProfile:
    base = {"memory_gib": 1.0, "memory_gbps": 1000.0, "fp32_tflops": 10.0, "bf16_tflops": 100.0, "host_gbps": 10.0}
    return DeviceProfile(name="test", device_name="Test GPU", source={}, **{**base, **figures})


def test_roofline_runs_each_kind_in_series_unless_the_launches_take_longer():
    gpu = _profile(matmul_efficiency=1.0, conv_efficiency=0.5, memory_efficiency=0.25, launch_us=10.0)
    assert roofline_seconds((1e12, 0, 0, 0), gpu, "32-true") == pytest.approx(1e12 / 10e12)  # 0.1 s of matmuls
    assert roofline_seconds((1e12, 0, 0, 0), gpu, "bf16-mixed") == pytest.approx(1e12 / 100e12)  # the tensor rate
    assert roofline_seconds((0, 1e12, 0, 0), gpu, "32-true") == pytest.approx(1e12 / (10e12 * 0.5))  # convolutions
    assert roofline_seconds((0, 0, 1e9, 0), gpu, "32-true") == pytest.approx(1e9 / (1000e9 * 0.25))  # 4 ms of bytes
    assert roofline_seconds((1e12, 1e12, 1e9, 0), gpu, "32-true") == pytest.approx(0.1 + 0.2 + 4e-3)  # one by one
    assert roofline_seconds((1e6, 0, 1e3, 50), gpu, "32-true") == pytest.approx(50 * 10e-6)  # 0.5 ms of launches
    assert gpu.with_efficiency(0.6).efficiencies == {"matmul": 0.6, "conv": 0.6, "memory": 0.6}


def test_a_profile_probe_prices_each_phase_from_the_model_counts():
    sizes = Footprint(batch_size=32, precision="32-true", device="cpu", param_count=1_000_000, param_bytes=4_000_000,
                      grad_bytes=4_000_000, optimizer_bytes=8_000_000, activation_bytes=32_000_000,
                      peak_bytes=0)  # fmt: skip
    counts = StepCounts(model="M", precision="32-true", forward_flops_per_sample=1e9, forward_flops_fixed=0.0,
                        backward_flops_per_sample=2e9, backward_flops_fixed=0.0, forward_kernels=20,
                        backward_kernels=40, optimizer_kernels=2, input_bytes_per_sample=1000,
                        forward_conv_flops_per_sample=4e8, backward_conv_flops_per_sample=8e8,
                        forward_bytes_per_sample=1e6, backward_bytes_per_sample=2e6, backward_bytes_fixed=1e6,
                        optimizer_bytes=36e6)  # fmt: skip
    gpu = _profile(matmul_efficiency=1.0, conv_efficiency=0.5, memory_efficiency=0.5, launch_us=10.0)
    probe = profile_probe(64, sizes, counts, gpu, gather_seconds=1e-3)
    assert isinstance(probe, ProbeResult) and probe.batch_size == 64 and probe.device == "profile:test"
    # 64 samples: 38.4 GFLOP of matmuls at 10 TFLOP/s, 25.6 of convolutions at half that, 64 MB at 500 GB/s
    assert probe.forward_seconds == pytest.approx(38.4e9 / 10e12 + 25.6e9 / 5e12 + 64e6 / 500e9)
    assert probe.backward_seconds == pytest.approx(76.8e9 / 10e12 + 51.2e9 / 5e12 + 129e6 / 500e9)
    assert probe.optimizer_seconds == pytest.approx(36e6 / 500e9)  # its counted bytes: no FLOPs
    # The copy (6.4 µs over 10 GB/s) cannot hide under a forward the device is busy with: all of it and its launch
    assert probe.data_seconds == pytest.approx(1e-3 + 64 * 1000 / 10e9 + 10e-6)
    assert probe.activation_bytes == 64_000_000 and probe.peak_bytes == 4e6 + 4e6 + 8e6 + 64e6
    assert probe.compute_c0_seconds == pytest.approx(1e6 / 500e9, abs=1e-9)  # the backward's fixed bytes
    assert probe.compute_c1_seconds_per_sample == pytest.approx(1.8e9 / 10e12 + 1.2e9 / 5e12 + 3e6 / 500e9)


def test_a_batch_copy_hides_under_the_steps_issue_where_launches_bind_and_adds_where_the_device_is_busy():
    gather, copy, launch = 1e-3, 0.5e-3, 10e-6
    step = 2e-3  # max(issue, device) of the step alone
    # A CPU plan, or a batch gathered on the GPU: no copy, the data time is the gather in series with the step
    on_cpu = copy_added_seconds(0.0, issue_seconds=2e-3, device_seconds=1e-3, launch_seconds=launch)
    assert gather + on_cpu + step == gather + step
    # Launch-bound (2 ms of issue, 1 ms on the device): the device copies while the host issues, and waits no longer
    pinned = copy_added_seconds(copy, issue_seconds=2e-3, device_seconds=1e-3, launch_seconds=launch)
    assert gather + pinned + step == pytest.approx(gather + launch + max(step, copy))  # not gather + copy + step
    # ... up to the issue's lead on the device (1 ms): a 1.5 ms copy shows its last 0.5 ms
    hidden_in_part = copy_added_seconds(1.5e-3, issue_seconds=2e-3, device_seconds=1e-3, launch_seconds=launch)
    assert hidden_in_part == pytest.approx(launch + 0.5e-3)
    # Device-bound: the stream copies before it runs the step's kernels, so the whole copy adds
    busy = copy_added_seconds(copy, issue_seconds=0.2e-3, device_seconds=3e-3, launch_seconds=launch)
    assert busy == pytest.approx(launch + copy)
    # A launch-bound profile probe: 200 forward kernels at 10 µs (2 ms) against 0.13 ms of FLOPs
    sizes = Footprint(batch_size=64, precision="32-true", device="cpu", param_count=1000, param_bytes=4000,
                      grad_bytes=4000, optimizer_bytes=8000, activation_bytes=64_000, peak_bytes=0)  # fmt: skip
    counts = StepCounts(model="M", precision="32-true", forward_flops_per_sample=1e7, forward_flops_fixed=0.0,
                        backward_flops_per_sample=2e7, backward_flops_fixed=0.0, forward_kernels=200,
                        backward_kernels=400, optimizer_kernels=2, input_bytes_per_sample=100_000)  # fmt: skip
    probe = profile_probe(64, sizes, counts, _profile(launch_us=10.0), gather_seconds=1e-3)
    assert probe.data_seconds == pytest.approx(1e-3 + 10e-6)  # the 0.64 ms copy hides under the forward's issue


def test_the_launch_cost_is_the_devices_own_profiles_where_one_names_it(monkeypatch):
    from hslite.preflight_check.hardware import device_profile

    launch_seconds_on.cache_clear()
    assert launch_seconds_on("cpu") == launch_seconds_on("cuda:0 (Unknown GPU)") == DEFAULT_LAUNCH_US * 1e-6
    monkeypatch.setattr(device_profile, "list_devices", lambda: ["test"])
    monkeypatch.setattr(device_profile, "load_device", lambda name: _profile(launch_us=4.0))
    launch_seconds_on.cache_clear()
    try:
        assert launch_seconds_on("profile:test") == pytest.approx(4e-6)  # a what-if probe priced from its profile
        assert launch_seconds_on("cuda:0 (NVIDIA Test GPU)") == pytest.approx(4e-6)  # a probed GPU a profile names
        assert launch_seconds_on("cpu") == DEFAULT_LAUNCH_US * 1e-6
    finally:
        launch_seconds_on.cache_clear()


def test_efficiency_can_be_set_from_the_config():
    from hslite.recipe.gate import _device_profile

    cfg = load_config(None, ["preflight.device=h200", "preflight.device_efficiency=0.6"])
    assert _device_profile(cfg).efficiencies == {"matmul": 0.6, "conv": 0.6, "memory": 0.6}
    default = _device_profile(load_config(None, ["preflight.device=h200"]))
    assert default.efficiencies == load_device("h200").efficiencies


def _check_priced_from_the_profile(report: dict, code: int) -> None:
    # With the host work stubbed every figure is the profile's and the model's, so the decision is fixed. SSFTT at
    # b32 on an H100 is bound by its kernel launches and the host loop, which do not shrink with the batch: one GPU
    # at b128 pays them once for 4× the samples, and 8 GPUs at b32 reach a quarter of its throughput each: NO-GO.
    assert (report["decision"], code, report["exit_code"]) == ("NO-GO", 3, 3)
    rows = {row["plan"]: row for row in report["rows"]}
    singles = [row for row in rows.values() if row["plan"].startswith("1×") and row["fits"]]
    efficiency = rows[report["requested"]]["ecd"] / max(row["ecd"] for row in singles)
    assert report["efficiency"] == pytest.approx(efficiency) and efficiency < report["min_efficiency"]
    passing = [row for row in rows.values() if row["passes"]]
    assert report["best_passing"] == max(passing, key=lambda row: row["samples_per_second"])["plan"]
    assert report["compute_source"] == "profile:h100_sxm" and report["compute_measured"] is False
    assert report["efficiency"] is not None and report["best_single"] is not None
    used = report["compute_profile"]
    assert used["model"] == "SSFTT" and used["efficiencies"] == load_device("h100_sxm").efficiencies
    assert 1e7 < used["flops_per_sample"] < 1e9
    assert used["peak_flops"] == pytest.approx(989.4e12)  # the recipe's bf16-mixed is priced at the bf16 peak
    assert report["reasons"][0].startswith(
        f"compute priced from the h100_sxm profile (roofline by kernel kind: matmuls at e = {MATMUL_EFFICIENCY:g}, "
        f"convolutions {CONV_EFFICIENCY:g}, other kernels' bytes {MEMORY_EFFICIENCY:g}; SSFTT "
    )
    assert report["reasons"][0].endswith("GFLOP per sample forward+backward): not measured")
    assert any("device memory (79.1 GiB) from the h100_sxm profile" in reason for reason in report["reasons"])
    assert report["requested_prediction"]["memory_budget_bytes"] == load_device("h100_sxm").memory_bytes
    assert all(row["step_seconds"] > 0 for row in report["rows"])


def test_gpus_not_here_get_a_verdict_from_a_device_profile(capsys, no_gpu_here):
    code = main(["preflight", *IP8_HERE, *PRICE_ON_H100])
    _check_priced_from_the_profile(json.loads(capsys.readouterr().out), code)


@pytest.mark.realdata
def test_indian_pines_on_8_h100s_gets_a_verdict_from_the_profile(capsys, no_gpu_here, shared_data, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    from fixtures_data import write_real_format_cube

    from hslite.datasets.scenes import registry as scenes

    # The real ground truth beside a cube of the real shape and format: shared/data has no Indian Pines cube (its
    # README: too big), and the sizes, FLOPs and class count priced here depend on the shapes only.
    spec = scenes.get_scene_spec("indian_pines")
    write_real_format_cube(tmp_path / "indian_pines", "indian_pines")
    shutil.copy(shared_data / "indian_pines" / spec.gt_file.name, tmp_path / "indian_pines" / spec.gt_file.name)
    unchecked = dataclasses.replace(spec.cube_file, sha256=None, size_bytes=None)  # ours is not the real cube
    monkeypatch.setitem(scenes._SCENES, "indian_pines", dataclasses.replace(spec, cube_file=unchecked))
    code = main(["preflight", "recipe=indian_pines_8gpu", f"data.root={tmp_path}", *PRICE_ON_H100])
    _check_priced_from_the_profile(json.loads(capsys.readouterr().out), code)


def _measured_probe(plan) -> ProbeResult:
    """What a probe of one GPU returns here: 3 ms of forward and backward, 0.1 ms each of optimiser and data."""
    return ProbeResult(
        forward_seconds=1e-3, backward_seconds=2e-3, optimizer_seconds=1e-4, data_seconds=1e-4,
        batch_size=plan.batch_size, precision=plan.precision, threads=1, device="cuda:0", param_count=60_000,
        param_bytes=240_000, grad_bytes=240_000, optimizer_bytes=480_000, activation_bytes=1_000_000,
        peak_bytes=2_000_000, compute_c0_seconds=1e-3, compute_c1_seconds_per_sample=3e-5,
    )  # fmt: skip


def test_gpus_that_are_here_are_measured_and_the_profile_is_not_used(capsys, monkeypatch):
    from hslite.preflight_check.hardware.topology import load_topology
    from hslite.recipe import gate

    probed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gate, "visible_devices", lambda accelerator: 2)
    monkeypatch.setattr(
        gate, "probe_for_plans", lambda *args, **kwargs: lambda p: probed.append(p) or _measured_probe(p)
    )
    monkeypatch.setattr("hslite.recipe.recipe_parts.measure_step_overhead", lambda plan, classes, fresh=False: 1e-3)
    monkeypatch.setattr(gate, "forked_cuda_devices", lambda plan, from_profile: [])  # no CUDA generator here
    gpus_here = ["recipe=quickstart", "parallel.accelerator=gpu", "parallel.devices=2"]
    main(["preflight", *gpus_here, *PRICE_ON_H100])
    report = json.loads(capsys.readouterr().out)
    assert report["compute_source"] == "measured" and report["compute_profile"] is None
    assert any(
        "preflight.device=h100_sxm not used: compute measured on this box's NVIDIA H100 80GB HBM3, which takes "
        "precedence" in reason
        for reason in report["reasons"]
    )
    # What is priced is what was measured: one GPU probed at the requested batch, its step, the loop's figure; and
    # memory from the topology, not the profile's 79.1 GiB.
    assert {(p.accelerator, p.devices, p.batch_size) for p in probed} == {("gpu", 1, 64)}
    priced = report["requested_prediction"]
    assert priced["compute_seconds"] == pytest.approx(1e-3 + 2e-3 + 1e-4 + 1e-4)
    assert priced["loop_seconds"] == 1e-3 and priced["per_device_peak_bytes"] == 2_000_000
    assert priced["memory_budget_bytes"] == load_topology("nvlink_8").device_memory_bytes
