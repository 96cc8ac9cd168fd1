"""`train.refit`: validation chooses the epoch, a fresh model trains on training + validation pixels, and that is
the model the run tests, maps and hands to `hslite predict`."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import rasterio
from quick_fit import NO_PREFLIGHT, QUICK_FIT

from hslite.cli import main


def _chosen_epochs(run) -> int:
    """The epoch BestCheckpoint kept: the best val/OA, a tie going to the later epoch; counted from 1."""
    with (run / "logs" / "metrics.csv").open() as f:
        scores = [(float(r["val/OA"]), int(r["epoch"])) for r in csv.DictReader(f) if r.get("val/OA")]
    return max(scores)[1] + 1


@pytest.mark.filterwarnings("ignore::rasterio.errors.NotGeoreferencedWarning")  # synthetic_tiny has no georeference
@pytest.mark.parametrize(
    "recipe", ["quickstart", pytest.param("quickstart_cpu2", marks=[pytest.mark.slow, pytest.mark.distributed])]
)  # on 2 gloo processes each training spawns its ranks, and the refit weights come back as the first ones do
def test_refit_trains_on_training_and_validation_pixels_for_the_epochs_validation_chose(recipe, tmp_path):
    args = [*QUICK_FIT, NO_PREFLIGHT, "train.max_epochs=5", "train.refit=true", "output.save_map=true",
            "data.train_fraction=0.3", "data.val_fraction=0.3", f"output.root={tmp_path}"]  # fmt: skip
    assert main(["fit", f"recipe={recipe}", *args]) == 0
    (run,) = (tmp_path / recipe).iterdir()
    metrics = json.loads((run / "metrics.json").read_text())
    pixels = metrics["split_protocol"]["pixels"]
    assert metrics["refit"]["epochs"] == _chosen_epochs(run)
    assert metrics["refit"]["train_pixels"] == pixels["train"] + pixels["val"]
    with (run / "logs" / "refit" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert max(int(r["epoch"]) for r in rows) + 1 == metrics["refit"]["epochs"]  # those epochs, and no more
    # what the ranks trained on, counted by them: a spawned rank re-runs setup(), which once forgot the validation
    # pixels (DistributedSampler pads each epoch to a multiple of the ranks)
    first_epoch = next(float(r["perf/train_samples"]) for r in rows if r.get("perf/train_samples"))
    assert first_epoch == pytest.approx(pixels["train"] + pixels["val"], abs=metrics["plan"]["devices"] - 1)
    # The tested model is the refit one, and predict loads it: its map of the scene is the run's own.
    assert main(["predict", f"run={run}", "progress=false"]) == 0
    (out,) = (run / "predict").iterdir()
    with rasterio.open(run / "prediction.tif") as ours, rasterio.open(out / "prediction.tif") as theirs:
        np.testing.assert_array_equal(ours.read(), theirs.read())


def test_the_log_interval_is_an_epoch_of_each_ranks_steps_at_most():
    from hslite.parallel.plan import Plan
    from hslite.run.evaluate import log_interval

    two = Plan(devices=2, accelerator="cpu")
    assert log_interval(33, two, 1.0) == 16 and log_interval(33, Plan(), 1.0) == 33  # each rank steps 33 // 2 times
    assert log_interval(500, Plan(), 1.0) == 50 and log_interval(500, Plan(), 7) == 7 and log_interval(1, two, 1.0) == 1
