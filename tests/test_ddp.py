"""Data parallelism through the Plan, for real: 2 gloo processes launched by Lightning, checked against one process.

Spawned ranks unpickle what they run, so helpers here live at module level.
"""

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from hslite.datasets.batches.patches import PatchDataset, collate_patches
from hslite.datasets.scenes.registry import load_scene
from hslite.models import get_model
from hslite.parallel.channels.rotation import RotationSchedule
from hslite.parallel.plan import Plan
from hslite.parallel.trainer.trainer_args import trainer_kwargs
from hslite.task import HSIClassifier

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SAMPLES = 96  # divisible by every global batch below, so DistributedSampler pads nothing


def fixed_dataset() -> PatchDataset:
    """The first SAMPLES labelled pixels of synthetic_tiny as 3×3 patches."""
    from hslite.datasets.batches.patches import PatchGatherer
    from hslite.datasets.preprocess import pad_reflect

    scene = load_scene("synthetic_tiny", seed=0)
    coords = torch.nonzero(torch.as_tensor(scene.gt) > 0)[:SAMPLES]
    labels = torch.as_tensor(scene.gt)[coords[:, 0], coords[:, 1]] - 1
    gatherer = PatchGatherer(pad_reflect(scene.cube / scene.cube.max(), 3), 3)
    return PatchDataset(gatherer, coords.numpy(), labels.numpy())


class FixedData(pl.LightningDataModule):
    """`fixed_dataset` in a fixed order (no shuffle)."""

    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        dataset = fixed_dataset()
        # Lightning's own DistributedSampler always shuffles training data; a fixed order needs our own sampler,
        # sharded as the strategy says (channel-group ranks share a shard).
        sampler = None
        if torch.distributed.is_initialized():
            sampler = DistributedSampler(dataset, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_patches)


class CountSyncs(pl.Callback):
    """Log the compression hook's call count for one kind so it comes back from the spawned ranks."""

    def __init__(self, kind: str = "none"):
        self.kind = kind

    def on_train_epoch_end(self, trainer, pl_module):
        pl_module.log("hook_calls", float(trainer.strategy.compression_state.calls[self.kind]), reduce_fx="max")


class SGDClassifier(HSIClassifier):
    """HSIClassifier with SGD and momentum, for comparing layouts: an update linear in the gradient keeps two layouts
    that sum one gradient in other orders within rounding of each other, on any CPU. AdamW divides by √v, so a
    gradient that is zero up to rounding (attention's key bias) becomes a full step of random sign, and the rounding
    itself depends on the CPU's vector width: an AVX-512 EPYC parted where an AVX2 one did not."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)


def train(plan: Plan, epochs: int = 2, callbacks=(), strategy=None, model_name: str = "cnn1d", schedule_chag=None):
    torch.manual_seed(0)
    model = get_model(model_name, in_bands=32, num_classes=4, patch_size=3)
    task = SGDClassifier(model, num_classes=4, lr=1e-1, warmup_epochs=0)
    if plan.rotation_enabled:
        chag = schedule_chag or plan.chag  # one process can follow a chag run's schedule (one group per rank)
        task.rotation = RotationSchedule(model.band_groups, plan.rotation_groups, seed=0, chag=chag)
    kwargs = trainer_kwargs(plan, progress=False)
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = pl.Trainer(
        **{**kwargs, "callbacks": [*kwargs["callbacks"], *callbacks]},
        max_epochs=epochs,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    trainer.fit(task, datamodule=FixedData(plan.batch_size))
    return task, trainer


def test_two_processes_equal_one_process_on_the_same_global_batches():
    single, _ = train(Plan(devices=1, batch_size=16))
    double, _ = train(Plan(devices=2, batch_size=8))
    for (name, a), (_, b) in zip(single.state_dict().items(), double.state_dict().items(), strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"{name} differs")


@pytest.mark.parametrize(
    "devices, chag, batch, rotation",
    [
        pytest.param(2, 2, 16, 0, id="chag2", marks=pytest.mark.slow),  # chag2-rotation runs the same path and more
        pytest.param(4, 2, 8, 0, id="dp2xchag2", marks=pytest.mark.slow),
        pytest.param(2, 1, 8, 2, id="dp2-rotation", marks=pytest.mark.slow),
        pytest.param(2, 2, 16, 2, id="chag2-rotation"),
    ],
)
def test_channel_groups_and_rotation_through_lightning_equal_one_process(devices, chag, batch, rotation):
    # Rotation: the inactive groups' parameters are unused on every rank; DDP must leave their gradients unset,
    # as one process does, or weight decay would move them and the runs would part.
    reference = Plan(devices=1, batch_size=16, rotation_groups=rotation)
    single, _ = train(reference, model_name="channel_vit", schedule_chag=chag)
    plan = Plan(devices=devices, chag=chag, batch_size=batch, rotation_groups=rotation)
    split, trainer = train(plan, model_name="channel_vit")
    assert type(trainer.strategy).__name__ == ("ChannelGroupDDPStrategy" if chag > 1 else "FencedDDPStrategy")
    for (name, a), (_, b) in zip(single.state_dict().items(), split.state_dict().items(), strict=True):
        if a.is_floating_point():  # channel groups sum a batch's gradient in another order: rounding apart
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"{name} differs")


@pytest.mark.slow
def test_channel_groups_with_a_compressed_all_reduce_register_the_hook_and_track_plain_channel_groups():
    plain, _ = train(Plan(devices=2, chag=2, batch_size=16), epochs=1, model_name="channel_vit")
    compressed, trainer = train(
        Plan(devices=2, chag=2, batch_size=16, compression="bf16"), epochs=1, callbacks=[CountSyncs("bf16")],
        model_name="channel_vit",
    )  # fmt: skip
    assert type(trainer.strategy).__name__ == "ChannelGroupCompressedDDPStrategy"
    assert trainer.callback_metrics["hook_calls"].item() > 0  # every gradient went through hslite's bf16 hook
    torch.manual_seed(0)
    start = get_model("channel_vit", in_bands=32, num_classes=4, patch_size=3).state_dict()
    for (name, a), (_, b) in zip(plain.state_dict().items(), compressed.state_dict().items(), strict=True):
        # bf16 keeps 8 significant bits, so each step's averaged gradient is off by about 2^-8 of its parts (channel
        # groups' ranks send chag × their slice's gradient, whose parts can cancel): compared as how far the bf16
        # run parted from fp32 against how far the weights moved at all, ≤ 2^-6 (0.5 % measured on an AVX-512 EPYC).
        moved, parted = (a - start[name.removeprefix("model.")]).norm(), (b - a).norm()
        assert parted <= 2**-6 * moved + 1e-7, f"{name} parted from plain channel groups by {parted / moved:.3%}"


def test_accumulation_skips_the_all_reduce_on_non_final_micro_steps():
    # 96 samples / (2 ranks × 8) = 6 micro-batches per epoch per rank; accumulate 3 -> 2 syncs per epoch.
    from hslite.parallel.strategies.ddp import CompressedDDPStrategy

    counting = CompressedDDPStrategy("none", start_method="spawn", process_group_backend="gloo")  # fp32, counted
    _, trainer = train(Plan(devices=2, batch_size=8, accumulate=3), callbacks=[CountSyncs()], strategy=counting)
    assert trainer.callback_metrics["hook_calls"].item() == 4


def test_amp_plan_trains_in_bf16_and_tracks_fp32():
    torch.manual_seed(0)
    start = get_model("cnn1d", in_bands=32, num_classes=4, patch_size=3).state_dict()
    fp32, _ = train(Plan(devices=1, batch_size=16), epochs=1)
    amp, trainer = train(Plan(devices=1, batch_size=16, precision="bf16-mixed"), epochs=1)
    assert type(trainer.precision_plugin).__name__ == "MixedPrecision"
    for name, a in fp32.model.state_dict().items():
        b = amp.model.state_dict()[name]
        assert b.dtype == torch.float32, f"{name}: master weights stay fp32 under AMP"
        step_fp32, step_amp = (a - start[name]).flatten(), (b - start[name]).flatten()
        cosine = torch.nn.functional.cosine_similarity(step_fp32, step_amp, dim=0)
        assert cosine > 0.9, f"{name}: bf16 updates point elsewhere than fp32's (cosine {cosine:.3f})"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_progress_bar_on_rank_zero_does_not_deadlock_the_epoch_end_metrics():
    # The rich bar reads the logged metrics on rank 0 alone; a value logged with sync_dist would be all-reduced there
    # while rank 1 waits in torchmetrics' sync: the README's two-process fit hung at its first epoch end.
    from hslite.parallel.timing import TrainThroughput

    torch.manual_seed(0)
    task = HSIClassifier(get_model("cnn1d", in_bands=32, num_classes=4, patch_size=3), num_classes=4, warmup_epochs=0)
    kwargs = trainer_kwargs(Plan(devices=2, batch_size=16), progress=True)
    trainer = pl.Trainer(
        **{**kwargs, "callbacks": [TrainThroughput(), *kwargs["callbacks"]]},
        max_epochs=2, limit_val_batches=0, logger=False, enable_checkpointing=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(task, datamodule=FixedData(16))
    assert trainer.callback_metrics["perf/epochs"].item() == 2


@pytest.mark.slow
def test_a_dp2_chag2_rank_sends_the_bytes_the_preflight_predicts():
    # Measured: DDP's all-reduce of the shared parameters (ring formula), the band groups' own gradients summed over
    # their dp peers and the token exchange (both counted). Predicted from the model's footprint.
    from hslite.parallel.trainer.usage import RankUsage, usage_metrics
    from hslite.preflight_check.measure.footprint import measure_footprint
    from hslite.preflight_check.price.comm_cost import chag_token_bytes, grad_bytes_per_step

    plan = Plan(devices=4, chag=2, batch_size=8)
    _, trainer = train(plan, epochs=1, callbacks=[RankUsage()], model_name="channel_vit")
    usage = usage_metrics(trainer.callback_metrics, "cpu")
    factory = lambda: get_model("channel_vit", in_bands=32, num_classes=4, patch_size=3)  # noqa: E731
    model = factory()
    sizes = measure_footprint(
        factory, lambda b: (torch.randn(b, 32, 3, 3), torch.randint(0, 4, (b,))), batch_size=8,
        precision="32-true", band_group_sizes=[stop - start for start, stop in model.band_groups],
    )  # fmt: skip
    predicted = grad_bytes_per_step(plan, sizes) + 2 * chag_token_bytes(plan, sizes)
    assert usage["counted_bytes_per_step"] + usage["computed_bytes_per_step"] == pytest.approx(predicted, rel=1e-3)
    # Against every gradient all-reduced over the 4 ranks: the groups' own leave it (2·3/4 of them), and each rank
    # sums its two groups' over its dp peer instead (2·1/2 of half of them).
    group_bytes = sum(sizes.group_grad_bytes)
    assert group_bytes > 0
    everything = 2 * 3 / 4 * sizes.grad_bytes + 2 * chag_token_bytes(plan, sizes)
    assert predicted == pytest.approx(everything - 2 * 3 / 4 * group_bytes + 2 * 1 / 2 * group_bytes / 2)
