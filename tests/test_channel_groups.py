"""Channel groups for real: gloo processes, each encoding its own band groups, checked against one process.

Forward output, loss and every parameter gradient equal one process with the same weights and batch (fp32,
relative error ≤ 1e-5), and so do the parameters after a few optimiser steps; a chag rank saves a fraction of the
activations. Spawned ranks unpickle what they run, so the workers live at module level.
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from hslite.errors import ConfigError
from hslite.models import get_model
from hslite.parallel.channel_groups import ChannelGroups, check_divides
from hslite.preflight.activations import SavedTensorCounter

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

BATCH, BANDS, PATCH, CLASSES, GROUPS = 8, 32, 5, 5, 4


class _ChannelGroupForward(nn.Module):
    """What the task's forward does under a channel-group strategy, as a module DDP can wrap."""

    def __init__(self, model: nn.Module, channel_groups: ChannelGroups):
        super().__init__()
        self.model, self.channel_groups = model, channel_groups

    def forward(self, x):
        return self.channel_groups(self.model, x)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _start(rank: int, world: int, init_file: str, chag: int):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // chag, chag), mesh_dim_names=("dp", "chag"))
    return ChannelGroups(GROUPS, chag, rank % chag, mesh.get_group("chag"))


def _exactness_worker(rank: int, world: int, chag: int, init_file: str, out: str) -> None:
    groups = _start(rank, world, init_file, chag)
    torch.manual_seed(0)
    model = get_model("channel_vit", in_bands=BANDS, num_classes=CLASSES, patch_size=PATCH, num_groups=GROUPS)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, BANDS, PATCH, PATCH, generator=generator)
    y = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    loss_fn = nn.CrossEntropyLoss()

    dp, dp_rank = world // chag, rank // chag
    shard = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    ddp = DistributedDataParallel(_ChannelGroupForward(model, groups), find_unused_parameters=True)
    errors: dict[str, float] = {}

    reference_logits = reference(x)
    reference_loss = loss_fn(reference_logits, y)
    reference_loss.backward()
    logits = ddp(x[shard])
    loss = loss_fn(logits, y[shard])
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)  # every chag rank holds its dp shard's loss: the mean over all ranks is the dp mean
    errors["logits"] = _relative_error(logits.detach(), reference_logits.detach()[shard])
    errors["loss"] = _relative_error(mean_loss / world, reference_loss.detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        errors[f"grad {name}"] = _relative_error(p.grad, q.grad)

    # SGD, not Adam: attention's key bias has a gradient of zero up to rounding, which Adam would scale up to
    # lr-sized steps of random sign in both runs alike (a property of Adam, not of channel groups).
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    for _ in range(3):  # a short training run: the same steps on both
        for optimiser in optimisers:
            optimiser.step()
            optimiser.zero_grad()
        loss_fn(ddp(x[shard]), y[shard]).backward()
        loss_fn(reference(x), y).backward()
    for optimiser in optimisers:
        optimiser.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        errors[f"trained {name}"] = _relative_error(p.detach(), q.detach())
    if rank == 0:
        Path(out).write_text(json.dumps(errors))
    dist.destroy_process_group()


def _run(worker, world: int, *args) -> None:
    mp.spawn(worker, args=(world, *args), nprocs=world, join=True)


@pytest.mark.parametrize("world, chag", [(2, 2), (4, 4), (4, 2)], ids=["chag2", "chag4", "dp2xchag2"])
def test_channel_groups_equal_one_process(tmp_path, world, chag):
    out = tmp_path / "errors.json"
    _run(_exactness_worker, world, chag, str(tmp_path / "init"), str(out))
    errors = json.loads(out.read_text())
    assert {k for k in errors if k.startswith("grad ")} == {f"grad {n}" for n, _ in _model().named_parameters()}
    worst = {name: error for name, error in errors.items() if error > 1e-5}
    assert worst == {}, f"relative errors above 1e-5: {worst}"


def _model(bands: int = BANDS) -> nn.Module:
    torch.manual_seed(0)
    return get_model("channel_vit", in_bands=bands, num_classes=CLASSES, patch_size=PATCH, num_groups=GROUPS)


def _saved_bytes(forward, model: nn.Module, x: torch.Tensor) -> int:
    counter = SavedTensorCounter(model)
    with counter:
        forward(x)
    return counter.total_bytes


def _memory_worker(rank: int, world: int, init_file: str, out: str) -> None:
    groups = _start(rank, world, init_file, world)
    model = _model(bands=200)
    x = torch.randn(16, 200, 9, 9, generator=torch.Generator().manual_seed(2))
    saved = {
        "rank": _saved_bytes(lambda batch: groups(model, batch), model, x),
        "one process": _saved_bytes(model, model, x),
        "tokenizer": _saved_bytes(lambda batch: model.encode_groups(batch, range(GROUPS)), model, x),
    }
    Path(f"{out}.{rank}").write_text(json.dumps(saved))
    dist.destroy_process_group()


def test_a_chag4_rank_saves_a_quarter_of_the_tokenizer_activations_at_200_bands(tmp_path):
    out = tmp_path / "bytes.json"
    _run(_memory_worker, 4, str(tmp_path / "init"), str(out))
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(4)]
    whole, tokenizer = ranks[0]["one process"], ranks[0]["tokenizer"]
    replicated = whole - tokenizer  # the final aggregation and the encoder, which every chag rank runs
    for saved in ranks:  # 4 equal groups of 50 bands: every rank holds exactly its quarter plus the replicated rest
        assert saved["rank"] == pytest.approx(tokenizer / 4 + replicated, rel=0.01)
    print(f"chag=4 rank saves {ranks[0]['rank'] / whole:.1%} of chag=1; tokenizer share {tokenizer / whole:.1%}")
    assert max(saved["rank"] for saved in ranks) < 0.35 * whole


def test_chag_must_divide_the_band_groups():
    check_divides(8, 4)
    with pytest.raises(ConfigError, match=r"parallel.chag=3 must divide the model's 8 band groups.*\[1, 2, 4, 8\]"):
        check_divides(8, 3)
