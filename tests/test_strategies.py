"""CompressedDDPStrategy under Lightning on CPU, and CompressionGuard's decisions.

The Lightning checks run tests/_dist_scripts/lightning_checks.py in a subprocess: Lightning forks 2 gloo ranks
(never strategy="ddp" inside pytest, whose re-launched children could fail behind a green parent).
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hslite.errors import ConfigError
from hslite.parallel.compression.guard import CompressionGuard
from hslite.parallel.strategies.ddp import CompressedDDPStrategy

SCRIPTS = Path(__file__).parent / "_dist_scripts"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "lightning_checks.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _end(out: Path, fit: str, rank: int) -> dict:
    return json.loads((out / f"{fit}_rank{rank}_end.json").read_text())


@pytest.mark.distributed
def test_hook_is_called_on_cpu(runs):
    for rank in (0, 1):
        end = _end(runs, "fit1", rank)
        # 5 steps: DDP's first step has one bucket, the 10 kB cap then gives 2 per step.
        assert end["calls"]["int8"] == 1 + 2 * 4
        assert end["step"] == 5 and end["bytes_sent"] > 0 and end["buckets"] == 2


@pytest.mark.distributed
def test_residuals_survive_checkpoint_and_resume(runs):
    saved = [torch.load(runs / f"fit1_rank{r}_save_step3.pt") for r in (0, 1)]
    restored = [torch.load(runs / f"fit2_rank{r}_start_step3.pt") for r in (0, 1)]
    for before, after in zip(saved, restored, strict=True):
        assert sorted(before) == sorted(after) and before  # every parameter has a residual
        assert all(torch.equal(before[name], after[name]) for name in before)
    assert not torch.equal(saved[0]["net.2.weight"], saved[1]["net.2.weight"])  # per-rank state, saved per rank
    for rank in (0, 1):
        end = _end(runs, "fit2", rank)
        # Statistics continue from the checkpoint: 5 calls up to step 3, then a fresh DDP's 1 + 2 + 2.
        assert end["calls"]["int8"] == 5 + 1 + 2 + 2 and end["step"] == 6
        assert end["loose_residuals"] == 0  # restored residuals were consumed by the resumed run's buckets


@pytest.mark.distributed
def test_guard_steps_compression_down_in_training(runs):
    ends = [_end(runs, "guard", rank) for rank in (0, 1)]
    assert ends[0]["switches"] == ends[1]["switches"]
    assert [(s["from"], s["to"]) for s in ends[0]["switches"]] == [("int8", "bf16"), ("bf16", "none")]
    for end in ends:
        assert end["kinds_after_validation"] == ["int8", "int8", "bf16", "bf16", "none"]
        assert end["calls"]["bf16"] > 0 and end["calls"]["none"] > 0 and end["buckets"] == 0  # residuals flushed
    (metrics,) = (runs / "guard_log").rglob("metrics.csv")
    with metrics.open() as f:
        levels = [float(row["compression/level"]) for row in csv.DictReader(f) if row["compression/level"]]
    assert levels == [8, 8, 16, 16, 32]


class StubStrategy:
    """What the guard uses of CompressedDDPStrategy; broadcast can impose rank 0's decision."""

    def __init__(self, kind: str = "int8", rank0_says=None) -> None:
        self.compression, self.rank0_says = kind, rank0_says

    def set_compression(self, kind: str) -> None:
        self.compression = kind

    def broadcast(self, obj, src=0):
        return obj if self.rank0_says is None else self.rank0_says


def _validate(guard: CompressionGuard, strategy, values, epochs=None) -> list[str]:
    kinds = []
    for i, value in enumerate(values):
        trainer = SimpleNamespace(
            strategy=strategy,
            callback_metrics={"val/OA": torch.tensor(value)},
            sanity_checking=False,
            current_epoch=i if epochs is None else epochs[i],
            global_step=10 * i,
            loggers=[],
        )
        guard.on_validation_end(trainer, None)
        kinds.append(strategy.compression)
    return kinds


def test_guard_against_its_own_best():
    guard = CompressionGuard(tolerance_points=1.0)
    kinds = _validate(guard, StubStrategy(), [0.80, 0.85, 0.845, 0.83, 0.846, 0.70, 0.60])
    assert kinds == ["int8", "int8", "int8", "bf16", "bf16", "none", "none"]
    assert [s["value"] for s in guard.switches] == pytest.approx([0.83, 0.70])


def test_guard_against_a_reference_curve_with_patience():
    guard = CompressionGuard(tolerance_points=2.0, reference={0: 0.50, 1: 0.70, 2: 0.80, 3: 0.85}, patience=2)
    kinds = _validate(guard, StubStrategy(), [0.49, 0.60, 0.81, 0.80, 0.78])
    # epoch 1 is 10 points short once (patience 2); epochs 3 and 4 (4 falls back to the best, 0.81) are 2 in a row.
    assert kinds == ["int8", "int8", "int8", "int8", "bf16"]


def test_guard_follows_rank_zero_and_checks_its_inputs():
    strategy = StubStrategy(rank0_says="bf16")
    assert _validate(CompressionGuard(reference=0.5), strategy, [0.9]) == ["bf16"]  # locally fine, rank 0 decided
    guard = CompressionGuard(monitor="val/kappa")
    with pytest.raises(ConfigError, match="val/OA"):
        _validate(guard, StubStrategy(), [0.9])
    with pytest.raises(ConfigError, match="set_compression"):
        guard.setup(SimpleNamespace(strategy=object()), None, "fit")
    restored = CompressionGuard()
    restored.load_state_dict(CompressionGuard().state_dict() | {"best": 0.9})
    assert restored.best == 0.9


def test_strategy_stores_and_switches_without_a_process_group():
    strategy = CompressedDDPStrategy("int8", chunk_elems=512, bucket_cap_mb=1.0)
    assert strategy.compression == "int8" and strategy.bucket_cap_mb == 1.0
    assert strategy.compression_state.chunk_elems == 512
    strategy.set_compression("bf16")
    assert strategy.compression == "bf16"
    with pytest.raises(ConfigError):
        strategy.set_compression("int4")
    with pytest.raises(ConfigError, match="ddp_comm_hook"):
        CompressedDDPStrategy(ddp_comm_hook=lambda state, bucket: None)


def test_the_kind_a_relaxed_run_ended_with_is_read_back_from_its_logged_level():
    from hslite.parallel.compression.guard import kind_at_level

    assert kind_at_level("int8", 8) == "int8"
    assert kind_at_level("int8", 16) == "bf16" and kind_at_level("int8", 32) == "none"
    assert kind_at_level("fp16", 16) == "fp16" and kind_at_level("fp16", 32) == "none"
    with pytest.raises(ConfigError, match="no compression reachable"):
        kind_at_level("bf16", 8)  # the guard never tightens


EXITING_RANK = """
import atexit
import torch
import torch.distributed as dist
import hslite.parallel.strategies.ddp as strategies
from hslite.parallel.strategies.fsdp import ShardedStrategy

# registered first, so it runs last: what the interpreter's finalization will find
atexit.register(lambda: print("group alive at finalization:", dist.is_initialized(), flush=True))
assert all(issubclass(s, strategies.DestroyedAtExit) for s in (strategies.FencedDDPStrategy, ShardedStrategy))
destroy = strategies._destroy_default_group
strategies._destroy_default_group = lambda: print("destroying", flush=True) or destroy()

class Base:
    def setup_environment(self):
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

class Rank(strategies.DestroyedAtExit, Base):
    pass

for _ in range(2):  # a process that fits twice destroys once
    Rank().setup_environment()
dist.all_reduce(torch.ones(4))
"""


def test_every_strategy_destroys_its_gloo_group_before_the_interpreter_finalizes():
    """Lightning destroys only "nccl" groups at exit; a gloo worker alive at finalization can abort a finished rank."""
    proc = subprocess.run([sys.executable, "-c", EXITING_RANK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["destroying", "group alive at finalization: False"], proc.stdout
