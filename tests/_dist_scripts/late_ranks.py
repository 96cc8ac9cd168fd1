"""`late_ranks.py N OUT`: N spawned gloo ranks of hslite's DDP strategy reach the rendezvous one after another, the last
well after the collective deadline has passed for the first, then train a step and meet at fences.

Writes `<spread of arrivals, s> <collective deadline, s> <ranks that finished> <their groups' deadlines, s>` to
OUT/result.txt.
"""

import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from hslite.parallel.deadlines import Deadlines
from hslite.parallel.strategies.ddp import FencedDDPStrategy

DEADLINES = Deadlines(collective=10.0, startup=300.0)
GAP_SECONDS = 1.0  # between two ranks' arrivals: 16 ranks span 15 s, past the 10 s collective deadline


class LateRanks(FencedDDPStrategy):
    """Each rank reaches the rendezvous GAP_SECONDS after the one before, as ranks that import slowly do."""

    def __init__(self, out: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out

    def setup_distributed(self) -> None:
        time.sleep(GAP_SECONDS * self.local_rank)
        (self.out / f"rank{self.local_rank}.arrived").write_text(repr(time.time()))
        super().setup_distributed()


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        return DataLoader(data, batch_size=2)

    def on_train_end(self) -> None:
        gloo = torch.distributed.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        (self.trainer.strategy.out / f"rank{self.global_rank}.done").write_text(repr(gloo.options._timeout.seconds))


def main() -> None:
    ranks, out = int(sys.argv[1]), Path(sys.argv[2])
    os.environ["OMP_NUM_THREADS"] = "1"
    strategy = LateRanks(out, start_method="spawn", process_group_backend="gloo", deadlines=DEADLINES)
    trainer = pl.Trainer(
        accelerator="cpu", devices=ranks, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Tiny())
    arrived = [float((out / f"rank{r}.arrived").read_text()) for r in range(ranks)]
    deadlines = {int(path.read_text()) for path in out.glob("rank*.done")}
    finished = len(list(out.glob("rank*.done")))
    (out / "result.txt").write_text(
        f"{max(arrived) - min(arrived)} {DEADLINES.collective} {finished} {','.join(map(str, sorted(deadlines)))}"
    )


if __name__ == "__main__":
    main()
