"""FSDP2 through the Plan, for real: 2 and 4 gloo processes against DDP on the same batches, shards and checkpoints.

Spawned ranks unpickle what they run, so helpers here live at module level.
"""

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from test_ddp import SAMPLES, FixedData, fixed_dataset, train

from hslite.models import get_model, list_models
from hslite.parallel.plan import Plan
from hslite.parallel.strategies.fsdp_policy import gathered_param_bytes, units
from hslite.parallel.trainer.trainer_args import trainer_kwargs
from hslite.run.checkpoints import AtomicCheckpointIO, load_weights
from hslite.task import HSIClassifier

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

STEPS = 50  # optimiser steps compared


class Trace(pl.Callback):
    """Rank 0's loss at every step, and every rank's bytes of parameters and AdamW state, written to `out`."""

    def __init__(self, out: Path):
        self.out = out
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP parameter is a DTensor: count this shard
            return t.numel() * t.element_size()

        optimizer = trainer.optimizers[0]
        states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        held = {
            "params": sum(local_bytes(p) for p in pl_module.model.parameters()),
            "optimizer": sum(local_bytes(t) for t in states),
        }
        rank = trainer.global_rank
        (self.out / f"rank{rank}.json").write_text(json.dumps({**held, "losses": self.losses}))


def _trace(plan: Plan, out: Path) -> list[dict]:
    out.mkdir()
    epochs = -(-STEPS * plan.global_batch // SAMPLES)
    _, trainer = train(plan, epochs=epochs, callbacks=[Trace(out)])
    if plan.fsdp:
        assert type(trainer.strategy).__name__ == "ShardedStrategy"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(plan.world_size)]


@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fsdp_loss_equals_ddp_over_50_steps_with_one_nth_of_the_parameters_and_optimiser_state(devices, tmp_path):
    ddp = _trace(Plan(devices=devices, batch_size=8), tmp_path / "ddp")
    fsdp = _trace(Plan(devices=devices, batch_size=8, fsdp=True), tmp_path / "fsdp")
    assert len(ddp[0]["losses"]) == len(fsdp[0]["losses"]) >= STEPS
    # The same arithmetic in another order: gradients are reduce-scattered per unit instead of all-reduced per bucket.
    torch.testing.assert_close(torch.tensor(fsdp[0]["losses"]), torch.tensor(ddp[0]["losses"]), rtol=1e-4, atol=1e-5)
    for kind in ("params", "optimizer"):
        whole = ddp[0][kind]
        shard = max(rank[kind] for rank in fsdp)
        assert shard == pytest.approx(whole / devices, rel=0.1), f"{kind}: {shard} bytes per rank of {whole}"


@pytest.mark.slow
def test_fsdp_bf16_gathers_in_bf16_keeps_fp32_shards_and_tracks_fp32(tmp_path):
    fp32, _ = train(Plan(devices=2, batch_size=8, fsdp=True), epochs=1)
    bf16, _ = train(Plan(devices=2, batch_size=8, fsdp=True, precision="bf16-mixed"), epochs=1)
    torch.manual_seed(0)
    start = get_model("cnn1d", in_bands=32, num_classes=4, patch_size=3).state_dict()
    for name, a in fp32.model.state_dict().items():
        b = bf16.model.state_dict()[name]
        assert b.dtype == torch.float32, f"{name}: the weights handed back are the fp32 shards, gathered"
        cosine = torch.nn.functional.cosine_similarity((a - start[name]).flatten(), (b - start[name]).flatten(), dim=0)
        assert cosine > 0.9, f"{name}: bf16 FSDP updates point elsewhere than fp32 FSDP's (cosine {cosine:.3f})"


@pytest.mark.slow
def test_fsdp_checkpoint_is_one_whole_file_that_evaluates_on_one_device(tmp_path):
    torch.manual_seed(0)
    task = HSIClassifier(get_model("cnn1d", in_bands=32, num_classes=4, patch_size=3), num_classes=4, lr=1e-2)
    kwargs = trainer_kwargs(Plan(devices=2, batch_size=8, fsdp=True), progress=False)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="last")
    trainer = pl.Trainer(
        **{**kwargs, "callbacks": [*kwargs["callbacks"], checkpoint]},
        max_epochs=2, limit_val_batches=0, logger=False, use_distributed_sampler=False, plugins=[AtomicCheckpointIO()],
    )  # fmt: skip
    trainer.fit(task, datamodule=FixedData(8))
    path = tmp_path / "last.ckpt"
    assert path.is_file(), "a full-state checkpoint is one file, not a folder of shards"
    saved = load_weights(path)
    for name, value in task.state_dict().items():  # the launcher hands the trained weights back whole too
        torch.testing.assert_close(saved[name], value, msg=f"{name}: checkpoint and returned weights differ")
    whole = torch.load(path, map_location="cpu", weights_only=True)
    assert whole["optimizer_states"][0]["state"], "the optimiser state is saved whole, for a resume on any world size"

    torch.manual_seed(1)
    fresh = HSIClassifier(get_model("cnn1d", in_bands=32, num_classes=4, patch_size=3), num_classes=4)
    fresh.load_state_dict(saved)
    x, _ = fixed_dataset().__getitems__(list(range(SAMPLES)))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), task(x))


def test_units_follow_each_architectures_policy_and_bound_the_gathered_bytes():
    model = get_model("hybridsn", in_bands=30, num_classes=16, patch_size=25)
    wrapped = units(model)
    assert model.fc[0] in wrapped and model.conv2d in wrapped and model.classifier not in wrapped
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(sum(p.numel() * p.element_size() for p in u.parameters()) for u in wrapped)
    assert largest < gathered_param_bytes(model) <= total
    with pytest.raises(TypeError, match="Linear declares no FSDP units"):
        units(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_declares_units_that_carry_most_of_its_parameters(name):
    model = get_model(name, in_bands=30, num_classes=16, patch_size=9)
    in_units = sum(p.numel() for u in units(model) for p in u.parameters())
    assert in_units > 0.5 * sum(p.numel() for p in model.parameters())
