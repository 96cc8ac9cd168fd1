"""OA, AA, kappa, per-class accuracy and the confusion matrix of HSIClassifier, checked against scikit-learn.

The task's own test loop runs (Lightning's test_step and on_test_epoch_end, over several batches) on logits built
from a known, imbalanced confusion matrix, with unlabelled pixels (-1) mixed in and one class never predicted.
"""

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, balanced_accuracy_score, cohen_kappa_score, confusion_matrix
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hslite.task import IGNORE_INDEX, HSIClassifier

# Rows: true class, columns: predicted class. 100 labelled pixels, classes of 50/30/15/5; class 3 is never predicted.
KNOWN_CONFUSION = np.array(
    [
        [40, 6, 4, 0],
        [5, 20, 5, 0],
        [1, 2, 12, 0],
        [2, 1, 2, 0],
    ]
)
UNLABELLED = 23  # pixels labelled -1, predicted as anything (class 3 included): they must change nothing


def _pixels(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(true, predicted) labels of every pixel of KNOWN_CONFUSION plus the unlabelled ones, shuffled."""
    rng = np.random.default_rng(seed)
    true, predicted = [], []
    for t, row in enumerate(KNOWN_CONFUSION):
        for p, count in enumerate(row):
            true += [t] * count
            predicted += [p] * count
    true += [IGNORE_INDEX] * UNLABELLED
    predicted += list(rng.integers(0, len(KNOWN_CONFUSION), UNLABELLED))
    order = rng.permutation(len(true))
    return np.array(true)[order], np.array(predicted)[order]


def _logits(predicted: np.ndarray, num_classes: int, seed: int = 0) -> torch.Tensor:
    """Random logits whose arg-max is `predicted`, so the metrics see scores, not ready-made labels."""
    logits = torch.randn(len(predicted), num_classes, generator=torch.Generator().manual_seed(seed))
    rows = torch.arange(len(predicted))
    logits[rows, torch.as_tensor(predicted)] = logits.max(dim=1).values + 1.0
    return logits


@pytest.fixture(scope="module")
def tested():
    """The task after one Lightning test run over batches of 37 pixels; the model passes the logits through."""
    true, predicted = _pixels()
    num_classes = len(KNOWN_CONFUSION)
    task = HSIClassifier(nn.Identity(), num_classes=num_classes)
    batches = DataLoader(TensorDataset(_logits(predicted, num_classes), torch.as_tensor(true)), batch_size=37)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    (logged,) = trainer.test(task, dataloaders=batches, verbose=False)
    labelled = true != IGNORE_INDEX
    return task, logged, true[labelled], predicted[labelled]


def test_the_known_pixels_give_the_known_confusion_matrix(tested):
    _, _, true, predicted = tested
    assert (confusion_matrix(true, predicted, labels=range(len(KNOWN_CONFUSION))) == KNOWN_CONFUSION).all()


def test_overall_accuracy_matches_sklearn(tested):
    _, logged, true, predicted = tested
    assert logged["test/OA"] == pytest.approx(accuracy_score(true, predicted))
    assert logged["test/OA"] == pytest.approx(72 / 100)  # the trace over the labelled pixels


def test_average_accuracy_is_balanced_accuracy(tested):
    _, logged, true, predicted = tested
    assert logged["test/AA"] == pytest.approx(balanced_accuracy_score(true, predicted))
    assert logged["test/AA"] == pytest.approx((40 / 50 + 20 / 30 + 12 / 15 + 0 / 5) / 4)  # class 3 counts, at 0


def test_kappa_matches_sklearn(tested):
    _, logged, true, predicted = tested
    assert logged["test/kappa"] == pytest.approx(cohen_kappa_score(true, predicted), abs=1e-6)


def test_per_class_accuracy_is_recall_per_class(tested):
    task, _, true, predicted = tested
    matrix = confusion_matrix(true, predicted, labels=range(len(KNOWN_CONFUSION)))
    recall = matrix.diagonal() / matrix.sum(axis=1)
    assert task.per_class_accuracy.numpy() == pytest.approx(recall)
    assert task.per_class_accuracy[3] == 0.0  # never predicted


def test_confusion_matrix_matches_sklearn_and_ignores_unlabelled(tested):
    task, _, true, predicted = tested
    assert task.confusion_matrix.numpy().tolist() == confusion_matrix(true, predicted).tolist()
    assert task.confusion_matrix.numpy().tolist() == KNOWN_CONFUSION.tolist()
    assert int(task.confusion_matrix.sum()) == KNOWN_CONFUSION.sum()  # the -1 pixels are nowhere
