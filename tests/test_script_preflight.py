"""The pre-flight of a team's own LightningModule: its own step probed, its Trainer's plan read, bad modules refused.

The gate across two launched processes runs in tests/test_examples.py (examples/own_script/train.py).
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import hslite
from hslite.errors import ConfigError
from hslite.parallel.plan import Plan
from hslite.preflight_check.measure.probe import ProbeOptions, ProbeTarget, probe_model
from hslite.preflight_check.measure.step_counts import count_step
from hslite.preflight_check.own_script.check import plan_from, plan_of_trainer
from hslite.preflight_check.own_script.lightning_step import lightning_workload
from hslite.strategies import CompressedDDPStrategy

STEP_SLEEP_SECONDS = 0.03
FEATURES, CLASSES = 16, 3


class SlowStepModule(pl.LightningModule):
    """A step hslite's own could not run: a dict batch, a loss of its own that sleeps, plain SGD (no state)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        self.steps = 0

    def training_step(self, batch, batch_idx):
        time.sleep(STEP_SLEEP_SECONDS)
        loss = nn.functional.mse_loss(self.net(batch["x"]), batch["target"])
        self.log("train_loss", loss)  # no Trainer while probed: silenced, not a warning per step
        return {"loss": loss, "extra": 1}

    def configure_optimizers(self):
        return {"optimizer": torch.optim.SGD(self.parameters(), lr=0.1)}


def dict_batch(rows: int = 8) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"x": torch.randn(rows, FEATURES, generator=generator), "target": torch.randn(rows, CLASSES),
            "scale": torch.tensor(2.0)}  # fmt: skip


def test_the_probe_times_the_modules_own_training_step_and_optimizer(recwarn):
    workload = lightning_workload(SlowStepModule(), dict_batch())
    result = probe_model(
        workload.model_factory,
        workload.make_batch,
        ProbeTarget(batch_size=8, precision="32-true", threads=1),
        ProbeOptions(warmup=1, steps=3, step=workload.step),
    )
    # hslite's classifier step (cross-entropy of model(x) against y, AdamW) would neither sleep nor read a dict batch
    assert result.forward_seconds >= STEP_SLEEP_SECONDS
    assert result.optimizer_bytes == 0  # SGD without momentum keeps no state; AdamW would hold twice the parameters
    assert result.param_count == sum(p.numel() for p in SlowStepModule().parameters())
    assert not [w for w in recwarn if "self.log" in str(w.message)]


def test_batches_of_any_size_cycle_the_rows_of_the_batch_the_script_gave():
    batch = dict_batch(rows=3)
    workload = lightning_workload(SlowStepModule(), batch)
    bigger = workload.make_batch(7)
    assert workload.batch_size == 3 and bigger["x"].shape == (7, FEATURES)
    torch.testing.assert_close(bigger["x"][3:6], batch["x"])
    assert bigger["scale"] is batch["scale"]  # not a per-sample tensor: left as it is


def test_flops_and_input_bytes_are_counted_on_the_modules_step():
    workload = lightning_workload(SlowStepModule(), dict_batch())
    counts = count_step(workload.model_factory, workload.make_batch, precision="32-true", step=workload.step)
    assert counts.forward_flops_per_sample == pytest.approx(2 * (FEATURES * 32 + 32 * CLASSES))
    # counted at 4 samples: their float rows and the batch's one shared float scalar, copied once per step
    assert counts.input_bytes_per_sample == (4 * 4 * (FEATURES + CLASSES) + 4) // 4


def test_the_probe_leaves_the_users_module_as_it_was():
    module = SlowStepModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    workload = lightning_workload(module, dict_batch())
    probe_model(
        workload.model_factory,
        workload.make_batch,
        ProbeTarget(batch_size=8, precision="32-true", threads=1),
        ProbeOptions(warmup=0, steps=1, step=workload.step),
    )
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, before[key])


class NoLoss(SlowStepModule):
    def training_step(self, batch, batch_idx):
        return None


class ReadsTrainer(SlowStepModule):
    def training_step(self, batch, batch_idx):
        return self.net(batch["x"]).sum() * self.trainer.max_epochs


class TwoOptimizers(SlowStepModule):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


class Manual(SlowStepModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class NoStep(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, CLASSES)


@pytest.mark.parametrize(
    ("module", "said"),
    [
        (NoLoss(), "training_step returned NoneType None"),
        (ReadsTrainer(), "training_step reads self.trainer"),
        (TwoOptimizers(), "configure_optimizers returned 2 optimisers"),
        (Manual(), "manual optimisation"),
        (NoStep(), "has no training_step of its own"),
        (nn.Linear(2, 2), "takes a LightningModule, got Linear"),
    ],
)
def test_a_module_the_probe_cannot_time_is_refused_in_a_sentence(module, said):
    with pytest.raises(ConfigError, match=said):
        workload = lightning_workload(module, dict_batch())
        probe_model(
            workload.model_factory,
            workload.make_batch,
            ProbeTarget(batch_size=8, precision="32-true", threads=1),
            ProbeOptions(warmup=0, steps=1, step=workload.step),
        )


def test_the_plan_is_the_one_the_trainer_runs():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=CompressedDDPStrategy("int8"), precision="bf16-mixed",
                         accumulate_grad_batches=3, logger=False)  # fmt: skip
    assert plan_of_trainer(trainer, 32) == Plan(devices=2, accelerator="cpu", batch_size=32, accumulate=3,
                                                precision="bf16-mixed", compression="int8")  # fmt: skip
    assert plan_of_trainer(pl.Trainer(accelerator="cpu", devices=1, logger=False), 8) == Plan(batch_size=8)


def test_a_plan_dict_names_only_the_plans_fields():
    assert plan_from({"devices": 4, "precision": "bf16-mixed"}) == Plan(devices=4, precision="bf16-mixed")
    with pytest.raises(ConfigError, match="plan has no field gpus; its fields are accelerator, accumulate"):
        plan_from({"gpus": 4})


@pytest.mark.slow
def test_hslite_preflight_of_a_module_on_one_device_is_a_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    verdict = hslite.preflight(module=SlowStepModule(), sample_batch=dict_batch(), plan={"devices": 1})
    assert verdict.go and verdict.requested == Plan(batch_size=8)
    assert any("SlowStepModule's own training_step and configure_optimizers" in r for r in verdict.reasons)
    with pytest.raises(ConfigError, match="exactly one of datamodule= and sample_batch="):
        hslite.preflight(module=SlowStepModule())


class PlainModule(SlowStepModule):
    """SlowStepModule without the sleep: counted on fake tensors, its step's time is not measured anyway."""

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch["x"]), batch["target"])


def test_a_module_is_priced_on_a_gpu_that_is_not_here_from_its_profile(tmp_path, monkeypatch):
    from hslite.preflight_check.hardware.device_profile import load_device

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    verdict = hslite.preflight(module=PlainModule(), sample_batch=dict_batch(rows=64),
                               plan={"devices": 8, "precision": "16-mixed"}, device="rtx_3090",
                               topology="pcie4_8")  # fmt: skip
    assert verdict.requested == Plan(devices=8, accelerator="gpu", batch_size=64, precision="16-mixed")
    assert verdict.compute_source == "profile:rtx_3090" and not verdict.compute_measured
    used = verdict.compute_profile
    assert used["model"] == "PlainModule" and used["efficiencies"] == load_device("rtx_3090").efficiencies
    forward = 2 * (FEATURES * 32 + 32 * CLASSES)  # backward: twice that, less the input's gradient nothing needs
    assert used["flops_per_sample"] == pytest.approx(forward + 2 * forward - 2 * FEATURES * 32)
    assert used["peak_flops"] == pytest.approx(71e12)  # 16-mixed at the fp16 tensor rate
    assert any("PlainModule's own training_step and configure_optimizers on fake tensors" in r for r in verdict.reasons)
    with pytest.raises(ConfigError, match="both device= .* and topology="):
        hslite.preflight(module=PlainModule(), sample_batch=dict_batch(), device="rtx_3090")
    with pytest.raises(ConfigError, match="a recipe names them as overrides"):
        hslite.preflight("quickstart", device="rtx_3090", topology="pcie4_8")
