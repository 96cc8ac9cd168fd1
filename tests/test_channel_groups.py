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

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from hslite.errors import ConfigError
from hslite.models import get_model
from hslite.parallel.channels.channel_groups import ChannelGroups, check_divides
from hslite.parallel.channels.group_gradients import GroupGradients
from hslite.parallel.channels.rotation import RotationSchedule
from hslite.preflight_check.measure.activations import SavedTensorCounter

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

BATCH, BANDS, PATCH, CLASSES, GROUPS = 8, 32, 5, 5, 4
COUNTS = ("bytes received", "group gradient bytes sent", "owned group elements")  # what a worker counted
WAVELENGTHS_NM = np.linspace(400.0, 2500.0, BANDS)


class _ChannelGroupForward(nn.Module):
    """What the task's forward does under a channel-group strategy, as a module DDP can wrap."""

    def __init__(self, model: nn.Module, channel_groups: ChannelGroups, active: list[int] | None = None):
        super().__init__()
        self.model, self.channel_groups, self.active = model, channel_groups, active

    def forward(self, x):
        return self.channel_groups(self.model, x, self.active)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:  # a chag rank's slice of a batch with fewer samples than ranks
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _start(rank: int, world: int, init_file: str, chag: int, model: nn.Module):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // chag, chag), mesh_dim_names=("dp", "chag"))
    sizes = [stop - start for start, stop in model.band_groups]
    return ChannelGroups(sizes, chag, rank % chag, mesh.get_group("chag")), mesh


def _exactness_worker(rank: int, world: int, chag: int, batch: int, rotation: int, init_file: str, out: str) -> None:
    torch.manual_seed(0)
    # Groups aligned to spectral regions: 5, 9, 9 and 9 bands, which the ranks own out of order (group_owners.py).
    model = get_model(
        "channel_vit", in_bands=BANDS, num_classes=CLASSES, patch_size=PATCH, num_groups=GROUPS,
        wavelengths_nm=WAVELENGTHS_NM,
    )  # fmt: skip
    groups, mesh = _start(rank, world, init_file, chag, model)
    # Under rotation, the first step's groups: ranks encode as many of their own (rotation.py), one process those.
    active = RotationSchedule(model.band_groups, rotation, seed=3, chag=chag).active_groups(0) if rotation else None
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, BANDS, PATCH, PATCH, generator=generator)
    y = torch.randint(0, CLASSES, (batch,), generator=generator)
    y[0] = -1  # an unlabelled pixel, and class weights: the loss's mean is over a weighted subset of the batch
    loss_fn = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, CLASSES), ignore_index=-1)

    dp, dp_rank = world // chag, rank // chag
    shards = [slice(d * batch // dp, (d + 1) * batch // dp) for d in range(dp)]
    shard = shards[dp_rank]
    forward = _ChannelGroupForward(model, groups, active)
    # The groups' own gradients are summed over their owners (group_gradients.py), as the strategy does.
    gradients = GroupGradients(model, groups.owners, rank % chag, mesh.get_group("dp"), mesh.get_group("chag"), world)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(forward, gradients.ignored_names(forward))
    ddp = DistributedDataParallel(forward, find_unused_parameters=True)
    others = {id(p) for p in gradients.parameters} - {id(p) for p in gradients.owned}
    errors: dict[str, float] = {}

    def reference_loss() -> torch.Tensor:  # plain DDP over the dp shards: the mean of the shards' losses
        return torch.stack([loss_fn(reference(x[s], active), y[s]) for s in shards]).mean()

    def backward() -> None:
        groups.loss_share(loss_fn, ddp(x[shard]), y[shard]).backward()
        gradients.reduce()

    reference_logits = reference(x, active)
    expected_loss = reference_loss()
    expected_loss.backward()
    logits = ddp(x[shard])
    share = groups.loss_share(loss_fn, logits, y[shard])
    share.backward()
    gradients.reduce()
    mean_loss = share.detach().clone()
    dist.all_reduce(mean_loss)  # DDP's mean of the shares: the dp shards' mean loss
    errors["logits"] = _relative_error(logits.detach(), groups.own_samples(reference_logits.detach()[shard]))
    errors["loss"] = _relative_error(mean_loss / world, expected_loss.detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if id(p) in others:  # another rank's group: no gradient here, not even zeros (its owner's file checks it)
            errors[f"gradient of another rank's group {name}"] = 0.0 if p.grad is None else float("inf")
        elif q.grad is None:  # a group rotation left out: no gradient on any rank either
            errors[f"grad {name}"] = 0.0 if p.grad is None or not p.grad.any() else float("inf")
        else:
            errors[f"grad {name}"] = _relative_error(p.grad, q.grad)

    # SGD, not Adam: attention's key bias has a gradient of zero up to rounding, which Adam would scale up to
    # lr-sized steps of random sign in both runs alike (a property of Adam, not of channel groups).
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    for _ in range(3):  # a short training run: the same steps on both
        for optimiser in optimisers:
            optimiser.step()
            optimiser.zero_grad()
        backward()
        reference_loss().backward()
    for optimiser in optimisers:
        optimiser.step()
    gradients.sync_replicas(optimisers[:1])  # every group's parameters and momentum from its owner
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        errors[f"trained {name}"] = _relative_error(p.detach(), q.detach())
        momentum = optimisers[1].state[q].get("momentum_buffer") if q in optimisers[1].state else None
        if momentum is not None and any(p is g for g in gradients.parameters):  # the state sync_replicas hands on
            errors[f"momentum {name}"] = _relative_error(optimisers[0].state[p]["momentum_buffer"], momentum)
    errors["bytes received"] = groups.bytes_received
    errors["group gradient bytes sent"] = gradients.bytes_sent
    errors["owned group elements"] = sum(p.numel() for p in gradients.owned)
    Path(out.format(rank=rank)).write_text(json.dumps(errors))
    dist.destroy_process_group()


def _run(worker, world: int, *args) -> None:
    mp.spawn(worker, args=(world, *args), nprocs=world, join=True)


@pytest.mark.parametrize(
    "world, chag, batch, rotation",
    [
        pytest.param(2, 2, 8, 0, id="chag2"),
        pytest.param(4, 4, 8, 0, id="chag4", marks=pytest.mark.slow),
        pytest.param(4, 2, 8, 0, id="dp2xchag2", marks=pytest.mark.slow),
        pytest.param(4, 4, 6, 0, id="chag4-uneven-slices", marks=pytest.mark.slow),
        pytest.param(4, 4, 3, 0, id="chag4-an-empty-slice", marks=pytest.mark.slow),
        pytest.param(2, 2, 8, 2, id="chag2-rotation", marks=pytest.mark.slow),
    ],
)
def test_channel_groups_equal_one_process(tmp_path, world, chag, batch, rotation):
    out = tmp_path / "errors-{rank}.json"
    _run(_exactness_worker, world, chag, batch, rotation, str(tmp_path / "init"), str(out))
    ranks = [json.loads(Path(str(out).format(rank=rank)).read_text()) for rank in range(world)]
    counts = [{key: errors.pop(key) for key in COUNTS} for errors in ranks]
    errors = {f"rank {rank} {name}": error for rank, e in enumerate(ranks) for name, error in e.items()}
    checked = {name.split(" ", 3)[-1] for name in errors if " grad " in name}
    assert checked == {n for n, _ in _model().named_parameters()}  # every gradient, on the rank that owns it
    worst = {name: error for name, error in errors.items() if error > 1e-5}
    assert worst == {}, f"relative errors above 1e-5: {worst}"
    # The groups' own gradients, 4 backwards: a ring all-reduce over the dp peers only, nothing at dp = 1.
    dp = world // chag
    for count in counts:
        owned = count["owned group elements"]
        assert count["group gradient bytes sent"] == (4 * 2 * (dp - 1) * -(-owned // dp) * 4 if dp > 1 else 0)
    received = counts[0]["bytes received"]
    # Rank 0, over 4 forward and backward passes: its slice's tokens of every group, then its groups' gradient for
    # its dp shard; one spatial token (patch 5 is cropped to one 3×3 sub-patch) of 64 fp32 dims per group and sample.
    shard = batch // (world // chag)
    slice_ = -(-shard // chag)
    token_bytes = 1 * 64 * 4
    groups = rotation or GROUPS  # rotation exchanges only the active groups' tokens
    assert received == 4 * (slice_ * groups + shard * groups // chag) * token_bytes


def _model(bands: int = BANDS) -> nn.Module:
    torch.manual_seed(0)
    return get_model("channel_vit", in_bands=bands, num_classes=CLASSES, patch_size=PATCH, num_groups=GROUPS)


def _saved_bytes(forward, model: nn.Module, x: torch.Tensor) -> int:
    counter = SavedTensorCounter(model)
    with counter:
        forward(x)
    return counter.total_bytes


def _memory_worker(rank: int, world: int, init_file: str, out: str) -> None:
    model = _model(bands=200)
    groups, _ = _start(rank, world, init_file, world, model)
    x = torch.randn(16, 200, 9, 9, generator=torch.Generator().manual_seed(2))
    saved = {
        "rank": _saved_bytes(lambda batch: groups(model, batch), model, x),
        "one process": _saved_bytes(model, model, x),
        "tokenizer": _saved_bytes(lambda batch: model.encode_groups(batch, range(GROUPS)), model, x),
    }
    Path(f"{out}.{rank}").write_text(json.dumps(saved))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_chag4_rank_saves_a_quarter_of_the_activations_at_200_bands(tmp_path):
    out = tmp_path / "bytes.json"
    _run(_memory_worker, 4, str(tmp_path / "init"), str(out))
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(4)]
    whole, tokenizer = ranks[0]["one process"], ranks[0]["tokenizer"]
    rest = whole - tokenizer  # the final aggregation and the encoder, which each chag rank runs on 4 of 16 samples
    for saved in ranks:  # 4 equal groups of 50 bands: every rank holds a quarter of the tokenizer and of the rest
        assert saved["rank"] == pytest.approx(tokenizer / 4 + rest / 4, rel=0.01)
    print(f"chag=4 rank saves {ranks[0]['rank'] / whole:.1%} of chag=1; tokenizer share {tokenizer / whole:.1%}")
    assert max(saved["rank"] for saved in ranks) <= 0.30 * whole


def test_chag_must_divide_the_band_groups():
    check_divides(8, 4)
    with pytest.raises(ConfigError, match=r"parallel.chag=3 must divide the model's 8 band groups.*\[1, 2, 4, 8\]"):
        check_divides(8, 3)


@pytest.mark.parametrize("batch, chag", [(8, 2), (7, 4), (3, 4)])
def test_the_ranks_loss_shares_average_to_the_batch_loss_and_their_samples_cover_it_once(batch, chag):
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(batch, CLASSES, generator=generator)
    y = torch.randint(0, CLASSES, (batch,), generator=generator)
    y[0] = -1
    loss_fn = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, CLASSES), ignore_index=-1)
    ranks = [ChannelGroups([2] * 4, chag, rank) for rank in range(chag)]  # no collective runs here
    rows = torch.arange(batch)
    assert torch.cat([r.own_samples(rows) for r in ranks]).tolist() == rows.tolist()
    shares = [r.loss_share(loss_fn, logits[r.own_samples(rows)], y) for r in ranks]
    torch.testing.assert_close(torch.stack(shares).mean(), loss_fn(logits, y))  # what DDP's mean makes of them


def _overflow_worker(rank: int, world: int, init_file: str, out: str) -> None:
    model = _model()
    groups, mesh = _start(rank, world, init_file, 2, model)
    gradients = GroupGradients(model, groups.owners, rank % 2, mesh.get_group("dp"), mesh.get_group("chag"), world)
    for p in gradients.owned:
        p.grad = torch.ones_like(p)
    if rank == 1:
        gradients.owned[0].grad[0] = float("inf")  # an fp16 overflow in one rank's groups only
    gradients.reduce(check_overflow=True)
    Path(f"{out}.{rank}").write_text(json.dumps(all(p.grad.isnan().all().item() for p in gradients.owned)))
    dist.destroy_process_group()


@pytest.mark.slow
def test_an_fp16_overflow_in_one_ranks_groups_makes_every_rank_skip_the_step(tmp_path):
    # The loss scaler of each rank sees only its own groups' gradients: all of them must see the overflow.
    out = tmp_path / "nan.json"
    _run(_overflow_worker, 2, str(tmp_path / "init"), str(out))
    assert [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)] == [True, True]


def test_channel_groups_refuse_gradient_norm_clipping():
    from types import SimpleNamespace

    from hslite.parallel.channels.channel_groups import ChannelGroupDDPStrategy

    trainer = SimpleNamespace(
        gradient_clip_val=1.0, gradient_clip_algorithm="norm", lightning_module=SimpleNamespace(model=_model())
    )
    with pytest.raises(ConfigError, match="gradient norm would differ by rank.*gradient_clip_algorithm='value'"):
        ChannelGroupDDPStrategy(2).setup(trainer)
