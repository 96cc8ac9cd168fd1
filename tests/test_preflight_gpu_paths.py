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
from hslite.preflight import probe as probe_module
from hslite.preflight import timers
from hslite.preflight.feature_costs import measure_fsdp_overhead
from hslite.preflight.launcher_cuda import device_memory_bytes
from hslite.preflight.measurements import LinkModel, ProbeResult
from hslite.preflight.run import run_preflight
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
    verdict = run_preflight(requested, probe_for, lambda plan: LinkModel(1e-5, 1e11), free_memory_bytes, 0.5, 2,
                            loop_seconds_for=loop_seconds_for)  # fmt: skip
    assert events[:4] == ["probe", "loop", "loop", "memory"]  # the ranks' and one rank's loop, then memory
    assert events.count("memory") == 1
    assert {pred.memory_budget_bytes for pred in verdict.predictions.values()} == {5 * GIB}


def test_gpu_plans_are_probed_with_their_cuda_math_and_preflight_json_records_it():
    probed: list[Plan] = []

    def probe_for(plan: Plan) -> ProbeResult:
        probed.append(plan)
        return tiny_probe(plan)

    requested = Plan(devices=2, accelerator="gpu", batch_size=32, tf32=False, cudnn_benchmark=False)
    verdict = run_preflight(requested, probe_for, lambda plan: LinkModel(1e-5, 1e11), 80 * GIB, 0.5, 2)
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


def _probe(device: str = "cuda:0", **kwargs) -> ProbeResult:
    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 4), torch.randint(0, 2, (b,))

    return probe_module.probe_model(lambda: nn.Linear(4, 2), make_batch, batch_size=8, precision="32-true",
                                    device=device, cache_key="linear", **kwargs)  # fmt: skip


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
