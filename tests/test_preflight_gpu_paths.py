"""The pre-flight's CUDA paths, checked on CPU with torch.cuda's functions replaced by recorders.

What the launching process does to GPUs before any rank starts: which random states it forks (each one a CUDA
context), which memory it prices, which CUDA math the probe times and leaves behind, what it hands back to the
allocator, which backend its own process group gets, and where its timers wait for the GPU.
"""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hslite.parallel.cuda_math import current_cuda_math, restore_cuda_math, set_cuda_math
from hslite.parallel.plan import Plan
from hslite.preflight_check.decide.check_plans import Scope, Sources, run_preflight
from hslite.preflight_check.hardware.launcher_cuda import device_memory_bytes
from hslite.preflight_check.measure import probe as probe_module
from hslite.preflight_check.measure import timers
from hslite.preflight_check.measure.feature_costs import measure_fsdp_overhead
from hslite.preflight_check.measurements import LinkModel, ProbeResult
from hslite.recipe import gate

GIB = 2**30
CUDA0 = torch.device("cuda:0")


def tiny_probe(plan: Plan) -> ProbeResult:
    """A GPU-style probe of a small model: 10 ms of compute, 1 MB of parameters."""
    return ProbeResult(
        forward_seconds=0.004, backward_seconds=0.006, optimizer_seconds=0.001, data_seconds=0.0,
        batch_size=plan.batch_size, precision=plan.precision, threads=1, device="cuda:0 (test)", param_count=250_000,
        param_bytes=1_000_000, grad_bytes=1_000_000, optimizer_bytes=2_000_000, activation_bytes=10_000_000,
        peak_bytes=20_000_000, compute_c0_seconds=0.0, compute_c1_seconds_per_sample=0.01 / plan.batch_size,
    )  # fmt: skip


@pytest.fixture
def four_gpus(monkeypatch):
    """A box with 4 CUDA devices, none initialised; fork_rng records the devices it is asked to fork."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    forked: list[list[torch.device]] = []

    @contextlib.contextmanager
    def fork_rng(devices=None, **kwargs):
        forked.append(list(devices))
        yield

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    return forked


def test_the_check_forks_the_random_state_of_the_probed_gpu_only(four_gpus, monkeypatch):
    check = gate._keeps_rng(lambda cfg, plan, *args, **kwargs: "checked")
    assert check(None, Plan(devices=4, accelerator="gpu")) == "checked"
    assert four_gpus == [[CUDA0]]  # not cuda:1-3: each fork would create a CUDA context on that GPU
    check(None, Plan(devices=4, accelerator="gpu"), from_profile=True)  # priced from a profile: no GPU work
    check(None, Plan(devices=2))  # CPU processes
    assert four_gpus[1:] == [[], []]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a caller already working on cuda:2
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    check(None, Plan(devices=2))
    assert four_gpus[-1] == [torch.device("cuda:2")]


def test_gpu_memory_is_priced_as_what_the_probed_gpu_has_free(four_gpus, monkeypatch):
    asked = []

    def mem_get_info(device=None):
        asked.append(device)
        return 3 * GIB, 141 * GIB  # (free, total): the rest is held by other processes and this one's context

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    total = SimpleNamespace(total_memory=141 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: total)
    assert device_memory_bytes("gpu") == 3 * GIB
    assert [torch.device(d) for d in asked] == [CUDA0]
    assert device_memory_bytes("cpu") > 0 and len(asked) == 1  # CPU processes: host memory, no GPU asked


def test_memory_is_read_once_after_the_first_probe_and_loop_measurement():
    events: list[str] = []

    def probe_for(plan: Plan) -> ProbeResult:
        events.append("probe")
        return tiny_probe(plan)

    def loop_seconds_for(plan: Plan) -> float:
        events.append("loop")
        return 1e-3

    def free_memory_bytes() -> int:
        events.append("memory")
        return 5 * GIB

    requested = Plan(devices=2, accelerator="gpu", batch_size=32)
    verdict = run_preflight(
        requested,
        Sources(probe_for, lambda plan: LinkModel(1e-5, 1e11), free_memory_bytes, loop_seconds_for=loop_seconds_for),
        Scope(max_devices=2),
        0.5,
    )
    assert events[:4] == ["probe", "loop", "loop", "memory"]  # the ranks' and one rank's loop, then memory
    assert events.count("memory") == 1
    assert {pred.memory_budget_bytes for pred in verdict.predictions.values()} == {5 * GIB}


def test_gpu_plans_are_probed_with_their_cuda_math_and_preflight_json_records_it():
    probed: list[Plan] = []

    def probe_for(plan: Plan) -> ProbeResult:
        probed.append(plan)
        return tiny_probe(plan)

    requested = Plan(devices=2, accelerator="gpu", batch_size=32, tf32=False, cudnn_benchmark=False)
    verdict = run_preflight(
        requested, Sources(probe_for, lambda plan: LinkModel(1e-5, 1e11), 80 * GIB), Scope(max_devices=2), 0.5
    )
    assert probed and all(not p.tf32 and not p.cudnn_benchmark for p in probed)
    report = json.loads(json.dumps(verdict.to_dict()))
    assert report["requested_plan"]["tf32"] is False and report["requested_plan"]["cudnn_benchmark"] is False


def _cuda_math_now() -> tuple:
    return current_cuda_math()


def _as_set(tf32: bool, benchmark: bool) -> tuple:
    """What the switches read after set_cuda_math(tf32, benchmark), in this torch's API."""
    previous = set_cuda_math(tf32, benchmark)
    try:
        return current_cuda_math()
    finally:
        restore_cuda_math(previous)


@pytest.fixture
def fake_cuda_probe(tmp_path, monkeypatch):
    """probe_model on "cuda:0", measuring replaced: records each measurement's CUDA math and each memory release."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    record = SimpleNamespace(math=[], released=[], defaults=_cuda_math_now(), fail=False)

    def measure(model_factory, make_batch, batch_size, precision, *args):
        record.math.append(_cuda_math_now())
        if record.fail:
            raise RuntimeError("CUDA out of memory (test)")
        return tiny_probe(Plan(accelerator="gpu", batch_size=batch_size, precision=precision))

    monkeypatch.setattr(probe_module, "measure_steps", measure)
    monkeypatch.setattr(probe_module, "device_label", lambda dev: f"{dev} (test GPU)")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: record.released.append("allocator cache"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: record.released.append("cublas"),
                        raising=False)  # fmt: skip
    yield record
    restore_cuda_math(record.defaults)  # monkeypatch cannot restore these process-wide switches


def _probe(device: str = "cuda:0", fresh: bool = False, **cuda_math) -> ProbeResult:
    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 4), torch.randint(0, 2, (b,))

    target = probe_module.ProbeTarget(8, "32-true", device=device, **cuda_math)
    options = probe_module.ProbeOptions(cache_key="linear", fresh=fresh)
    return probe_module.probe_model(lambda: nn.Linear(4, 2), make_batch, target, options)


def test_the_probe_times_the_plans_cuda_math_restores_it_and_caches_by_it(fake_cuda_probe):
    _probe(tf32=False, cudnn_benchmark=True)
    assert fake_cuda_probe.math == [_as_set(False, True)]  # as set_cuda_math sets them for the ranks
    assert _cuda_math_now() == fake_cuda_probe.defaults  # the process's own settings are back
    _probe(tf32=True, cudnn_benchmark=True)  # another plan's math is another measurement, not a cache hit
    _probe(tf32=True, cudnn_benchmark=False)
    assert fake_cuda_probe.math[1:] == [_as_set(True, True), _as_set(True, False)]
    _probe(tf32=True, cudnn_benchmark=False)
    assert len(fake_cuda_probe.math) == 3  # read from the cache
    _probe(device="cpu", tf32=False)
    _probe(device="cpu", tf32=True)  # the CPU reads neither switch: one measurement, under the process's settings
    assert fake_cuda_probe.math[3:] == [fake_cuda_probe.defaults]


def test_the_probe_hands_its_cached_gpu_memory_back_even_when_it_fails(fake_cuda_probe):
    _probe()
    assert fake_cuda_probe.released == ["cublas", "allocator cache"]
    _probe()  # a cache hit ran nothing on the GPU
    assert len(fake_cuda_probe.released) == 2
    fake_cuda_probe.fail = True
    with pytest.raises(RuntimeError, match="out of memory"):
        _probe(fresh=True)
    assert len(fake_cuda_probe.released) == 4 and _cuda_math_now() == fake_cuda_probe.defaults
    fake_cuda_probe.fail = False
    _probe(device="cpu")
    assert len(fake_cuda_probe.released) == 4  # a CPU probe leaves CUDA alone


def test_the_fsdp_probe_gets_the_process_group_backend_the_ranks_get(monkeypatch):
    backends = []

    class Recorded(Exception):
        pass

    def init_process_group(backend, **kwargs):
        backends.append(backend)
        raise Recorded  # nothing on a GPU can run here; the backend is what is checked

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    plain = tiny_probe(Plan(accelerator="gpu"))
    with pytest.raises(Recorded):
        measure_fsdp_overhead(lambda: nn.Linear(4, 2), (torch.randn(2, 4), torch.zeros(2)), plain)
    # An NCCL-only group has no CPU backend: a CPU tensor handed to one of its collectives fails.
    assert backends == ["cpu:gloo,cuda:nccl"]


@pytest.fixture
def synchronised(monkeypatch):
    """torch.cuda.synchronize replaced by a recorder; the list also takes what the timed function appends."""
    events: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("synchronize", device)))
    return events


def test_wall_seconds_waits_for_gpu_work_queued_before_and_by_the_timed_call(synchronised):
    timers.wall_seconds(lambda: synchronised.append("timed call"), CUDA0)
    assert synchronised == [("synchronize", CUDA0), "timed call", ("synchronize", CUDA0)]
    synchronised.clear()
    timers.wall_seconds(lambda: synchronised.append("timed call"), torch.device("cpu"))
    assert synchronised == ["timed call"]


def test_a_mark_is_recorded_on_the_stream_of_the_device_being_timed(monkeypatch):
    recorded = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self, stream=None) -> None:
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"current stream of {device}")
    timers.mark(torch.device("cuda:1"))
    assert recorded == ["current stream of cuda:1"]  # not the current device's, which may be another GPU


def test_cuda_math_is_left_alone_on_cpu():
    before = set_cuda_math(False, False)
    try:
        off = _cuda_math_now()
        with timers.cuda_math(True, True, torch.device("cpu")):
            assert _cuda_math_now() == off
        with timers.cuda_math(True, True, CUDA0):
            assert _cuda_math_now() == _as_set(True, True) != off
        assert _cuda_math_now() == off
    finally:
        restore_cuda_math(before)


class _RecordedScaler:
    """torch.amp.GradScaler's calls recorded, the loss scaled by 2 and the gradients unscaled as the real one does."""

    made_for: list[str] = []

    def __init__(self, device: str = "cuda") -> None:
        _RecordedScaler.made_for.append(device)
        self.calls: list[str] = []

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self.calls.append("scale")
        return loss * 2

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append("unscale_")
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad.div_(2)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append("step")
        optimizer.step()

    def update(self) -> None:
        self.calls.append("update")


def test_16_mixed_gets_lightnings_loss_scaler_on_a_gpu_and_no_other_precision_or_device_does(monkeypatch):
    monkeypatch.setattr(torch.amp, "GradScaler", _RecordedScaler)
    _RecordedScaler.made_for = []
    assert isinstance(timers.grad_scaler("16-mixed", CUDA0), _RecordedScaler)
    assert _RecordedScaler.made_for == ["cuda"]  # as Lightning's MixedPrecision makes it for a GPU accelerator
    # Lightning runs 16-mixed on CPU as bf16-mixed, and neither bf16 nor fp32 scales its loss
    cpu = torch.device("cpu")
    assert timers.grad_scaler("16-mixed", cpu) is None
    assert all(timers.grad_scaler(p, dev) is None for p in ("bf16-mixed", "32-true") for dev in (CUDA0, cpu))


def test_a_scaled_step_scales_the_loss_unscales_steps_and_updates_and_trains_as_the_plain_step():
    from hslite.preflight_check.measure.step_timing import timed_step
    from hslite.preflight_check.measure.training_step import CLASSIFIER_STEP

    cpu = torch.device("cpu")
    batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
    trained = []
    for scaler in (None, _RecordedScaler()):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        assert len(timed_step(model, optimizer, batch, "16-mixed", cpu, CLASSIFIER_STEP, scaler)) == 3
        trained.append(model.weight.detach().clone())
    assert scaler.calls == ["scale", "unscale_", "step", "update"]  # Lightning MixedPrecision's order
    assert torch.allclose(trained[0], trained[1])  # the gradient was unscaled before the step
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    fused = torch.optim.SGD(model.parameters(), lr=0.1)
    fused._step_supports_amp_scaling = True  # a fused optimiser unscales inside its own step: Lightning leaves it
    scaler = _RecordedScaler()
    timed_step(model, fused, batch, "16-mixed", cpu, CLASSIFIER_STEP, scaler)
    assert scaler.calls == ["scale", "step", "update"]


def test_on_a_gpu_each_batch_is_copied_as_lightning_copies_it_with_its_step_queued_right_behind(monkeypatch):
    from hslite.preflight_check.measure import step_timing
    from hslite.preflight_check.measure.training_step import CLASSIFIER_STEP

    events: list[str] = []
    steps: list[object] = []

    class OnGpu(nn.Linear):
        def to(self, *args, **kwargs):  # the model "moves" to the GPU and stays here
            return self

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        events.append("gather")
        return torch.randn(b, 4), torch.randint(0, 2, (b,))

    def timed_step(model, optimizer, batch, precision, dev, step, scaler):
        events.append("step")
        steps.append(scaler)
        return [1e-3, 2e-3, 1e-4]

    monkeypatch.setattr(torch.amp, "GradScaler", _RecordedScaler)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(step_timing, "mark", lambda dev: events.append("mark") or len(events))
    monkeypatch.setattr(step_timing, "intervals_seconds", lambda marks, dev: [5e-4] * (len(marks) - 1))
    monkeypatch.setattr(step_timing, "batch_to", lambda batch, dev: events.append("copy") or batch)
    monkeypatch.setattr(step_timing, "_as_loaded", lambda batch, dev: batch)
    monkeypatch.setattr(step_timing, "timed_step", timed_step)
    monkeypatch.setattr(step_timing, "device_label", lambda dev: "cuda:0 (test)")
    monkeypatch.setattr(step_timing, "model_sizes", lambda *args: dict(
        param_count=10, param_bytes=40, grad_bytes=40, optimizer_bytes=80, activation_bytes=0))  # fmt: skip
    result = step_timing.measure_steps(lambda: OnGpu(4, 2), make_batch, 8, "16-mixed", CUDA0, warmup=0, steps=2,
                                       step=CLASSIFIER_STEP, deadline=0.0)  # fmt: skip
    # Each timed step: its batch gathered (a gather on the GPU waited for), then the copy between two marks and the
    # step queued at once behind it, with no wait between them: what hides of the copy shows in the forward's time
    fed = ["gather", "synchronize", "mark", "copy", "mark", "step"]
    assert events[: 2 * len(fed)] == fed * 2
    assert 5e-4 <= result.data_seconds < 5e-4 + 0.05  # the gather's host seconds and the copy's 0.5 ms on the GPU
    assert len({id(s) for s in steps}) == 1 and isinstance(steps[0], _RecordedScaler)  # one scaler for the probe


def test_a_batch_whose_data_path_pins_is_page_locked_throughout_as_its_dataloader_hands_it_over(monkeypatch):
    from hslite.preflight_check.measure.step_timing import _as_loaded

    patches, labels = torch.randn(4, 3), torch.zeros(4, dtype=torch.long)
    pinned = {id(patches)}  # the datamodule gathers a GPU plan's patches into page-locked memory, not the labels

    def pin_memory(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) in pinned:
            return tensor
        copy = tensor.clone()
        pinned.add(id(copy))
        return copy

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda tensor, device=None: id(tensor) in pinned)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    x, y = _as_loaded((patches, labels), CUDA0)
    assert x is patches and y is not labels and torch.equal(y, labels) and y.is_pinned()  # as pin_memory=True does
    unpinned = (torch.randn(4, 3), labels)  # a loader that does not pin: copied as it is, holding the host
    assert all(a is b for a, b in zip(_as_loaded(unpinned, CUDA0), unpinned, strict=True))
    assert _as_loaded((patches, labels), torch.device("cpu"))[1] is labels  # no copy on CPU
