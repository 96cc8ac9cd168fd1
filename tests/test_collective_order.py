"""Every strategy and callback, in 2 gloo processes: each collective hands tensors the GPU backend can take, and
every rank issues the same collectives in the same order (collective_recorder.py says why both matter on NCCL).

The runs write checkpoints (the random-state and compression-residual gathers), time and count usage (their
epoch-end reductions) and use small DDP buckets, so that several buckets are ready before the token exchange on one
rank and after it on another: the case where channel groups' two communicators could be issued in different orders.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from collective_recorder import RecordCollectives, check_collectives, recorded
from lightning.pytorch.callbacks import ModelCheckpoint
from test_ddp import FixedData

from hslite.models import get_model
from hslite.parallel.channels.rotation import RotationSchedule
from hslite.parallel.deadlines import Deadlines
from hslite.parallel.plan import Plan
from hslite.parallel.timing import TrainThroughput
from hslite.parallel.trainer.trainer_args import process_group_backend, trainer_kwargs
from hslite.parallel.trainer.usage import RankUsage
from hslite.run.training_state import TrainingState
from hslite.task import HSIClassifier

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SMALL_BUCKET_MB = 0.002  # 2 kB: every few parameters make a bucket


class OwnTokenizers(torch.nn.Module):
    """A band-group model whose parameters are each group's own tokenizer, then a shared head: registered in that
    order, so DDP's last buckets hold only group tokenizers, ready at once on a rank that does not own them (unused)
    and after the token exchange's backward on the owner. (ChannelViT happens to register a shared post-exchange
    module among them, which hides the hazard; a team's own model need not.)"""

    def __init__(self, bands: int = 32, groups: int = 4, dim: int = 64, classes: int = 4):
        super().__init__()
        step = bands // groups
        self.band_groups = [(g * step, (g + 1) * step) for g in range(groups)]
        self.tokenizers = torch.nn.ModuleList(torch.nn.Linear(step * 9, dim) for _ in range(groups))
        self.classifier = torch.nn.Linear(dim, classes)

    def encode_groups(self, x, group_indices):
        n = len(x)
        return torch.stack(
            [self.tokenizers[g](x[:, slice(*self.band_groups[g])].reshape(n, -1)) for g in group_indices], dim=1
        ).unsqueeze(2)  # (n, g, 1, dim)

    def aggregate(self, group_tokens, group_indices):
        return group_tokens.mean(dim=1)

    def group_parameters(self, group_index):
        return list(self.tokenizers[group_index].parameters())

    def head(self, tokens):
        return self.classifier(tokens[:, 0])

    def forward(self, x):
        groups = range(len(self.band_groups))
        return self.head(self.aggregate(self.encode_groups(x, groups), groups))


OPTIONS = {"start_method": "spawn", "process_group_backend": "gloo", "deadlines": Deadlines(collective=60, startup=60)}


def _strategy(kind: str):
    from hslite.parallel.channels.channel_groups import ChannelGroupCompressedDDPStrategy, ChannelGroupDDPStrategy
    from hslite.parallel.strategies.ddp import CompressedDDPStrategy
    from hslite.parallel.strategies.fsdp import ShardedStrategy

    return {
        "ddp": lambda: None,  # the Plan's own
        "int8": lambda: CompressedDDPStrategy("int8", bucket_cap_mb=SMALL_BUCKET_MB, **OPTIONS),
        "chag2": lambda: ChannelGroupDDPStrategy(2, bucket_cap_mb=SMALL_BUCKET_MB, **OPTIONS),
        "chag2-rotation": lambda: ChannelGroupDDPStrategy(2, bucket_cap_mb=SMALL_BUCKET_MB, **OPTIONS),
        "chag2-fp32-hook": lambda: ChannelGroupCompressedDDPStrategy(
            2, compression="none", bucket_cap_mb=SMALL_BUCKET_MB, **OPTIONS
        ),
        "chag2-int8": lambda: ChannelGroupCompressedDDPStrategy(
            2, compression="int8", bucket_cap_mb=SMALL_BUCKET_MB, **OPTIONS
        ),
        "chag2-own-model": lambda: ChannelGroupCompressedDDPStrategy(
            2, compression="none", bucket_cap_mb=SMALL_BUCKET_MB, **OPTIONS
        ),
        "fsdp": lambda: ShardedStrategy(2, "32-true", "gloo"),
    }[kind]()


# chag2 runs in the quick suite: its token exchange and deferred buckets are where ranks' orders once diverged.
KINDS = [
    pytest.param(kind, marks=() if kind == "chag2" else pytest.mark.slow, id=kind)
    for kind in ("ddp", "int8", "chag2", "chag2-rotation", "chag2-fp32-hook", "chag2-int8", "chag2-own-model", "fsdp")
]


@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_issues_the_same_collectives_on_tensors_the_gpu_backend_takes(kind, tmp_path):
    chag = 2 if kind.startswith("chag") else 1
    rotation = 2 if kind.endswith("rotation") else 0
    plan = Plan(devices=2, chag=chag, batch_size=16 if chag > 1 else 8, rotation_groups=rotation)
    torch.manual_seed(0)
    if kind == "chag2-own-model":
        model = OwnTokenizers()
    else:
        model = get_model("channel_vit" if chag > 1 else "cnn1d", in_bands=32, num_classes=4, patch_size=3)
    task = HSIClassifier(model, num_classes=4, lr=1e-2, warmup_epochs=0)
    if rotation:
        task.rotation = RotationSchedule(model.band_groups, rotation, seed=0, chag=chag)
    kwargs = trainer_kwargs(plan, progress=False)
    strategy = _strategy(kind)
    if strategy is not None:
        kwargs["strategy"] = strategy
    folder = tmp_path / "calls"
    callbacks = [
        RecordCollectives(folder),
        TrainThroughput(),
        RankUsage(),
        TrainingState({"test": kind}),
        ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True),
    ]
    trainer = pl.Trainer(
        **{**kwargs, "callbacks": [*kwargs["callbacks"], *callbacks]},
        max_epochs=2, limit_val_batches=0, logger=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(task, datamodule=FixedData(plan.batch_size))
    calls = recorded(folder)
    check_collectives(calls, 2, process_group_backend("gpu"))
    ops = {call["op"] for call in calls[0]}
    assert "gather_object" in ops  # the checkpoint's random states (and int8 residuals) were gathered to rank 0
    assert "all_reduce" in ops  # the epoch-end timing and usage figures
    if kind.startswith("chag"):
        assert "all_to_all_single" in ops


def test_the_gpu_backend_serves_host_tensors_and_an_nccl_only_backend_would_not():
    from collective_recorder import backend_device_types

    assert backend_device_types(process_group_backend("gpu")) == {"cpu", "cuda"}
    assert process_group_backend("cpu") == "gloo"
    with pytest.raises(AssertionError, match="no backend for them"):
        check_collectives({0: [{"op": "all_reduce", "group": "world", "devices": ["cpu"], "dtypes": []}]}, 1, "nccl")
