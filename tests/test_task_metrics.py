"""OA, AA, kappa, per-class accuracy and the confusion matrix of HSIClassifier, checked against scikit-learn.

`HSIClassifier.score` (what `hslite fit` reports from its one inference pass) scores predictions built from a known,
imbalanced confusion matrix, with unlabelled pixels (-1) mixed in, one class never predicted and one never present.
"""

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, balanced_accuracy_score, cohen_kappa_score, confusion_matrix
from torch import nn

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


@pytest.fixture(scope="module")
def tested():
    """The task's scores of the known pixels; the model is never called."""
    true, predicted = _pixels()
    task = HSIClassifier(nn.Identity(), num_classes=len(KNOWN_CONFUSION))
    scores = task.score(torch.as_tensor(predicted), torch.as_tensor(true))
    labelled = true != IGNORE_INDEX
    return scores, true[labelled], predicted[labelled]


def test_the_known_pixels_give_the_known_confusion_matrix(tested):
    _, true, predicted = tested
    assert (confusion_matrix(true, predicted, labels=range(len(KNOWN_CONFUSION))) == KNOWN_CONFUSION).all()


def test_overall_accuracy_matches_sklearn(tested):
    logged, true, predicted = tested
    assert logged["OA"] == pytest.approx(accuracy_score(true, predicted))
    assert logged["OA"] == pytest.approx(72 / 100)  # the trace over the labelled pixels


def test_average_accuracy_is_balanced_accuracy(tested):
    logged, true, predicted = tested
    assert logged["AA"] == pytest.approx(balanced_accuracy_score(true, predicted))
    assert logged["AA"] == pytest.approx((40 / 50 + 20 / 30 + 12 / 15 + 0 / 5) / 4)  # class 3 counts, at 0


def test_kappa_matches_sklearn(tested):
    logged, true, predicted = tested
    assert logged["kappa"] == pytest.approx(cohen_kappa_score(true, predicted), abs=1e-6)


def test_per_class_accuracy_is_recall_per_class(tested):
    scores, true, predicted = tested
    matrix = confusion_matrix(true, predicted, labels=range(len(KNOWN_CONFUSION)))
    recall = matrix.diagonal() / matrix.sum(axis=1)
    assert scores["per_class_accuracy"] == pytest.approx(recall.tolist())
    assert scores["per_class_accuracy"][3] == 0.0  # never predicted


def test_a_class_with_no_test_pixel_has_no_accuracy():
    task = HSIClassifier(nn.Identity(), num_classes=3)
    scores = task.score(torch.tensor([0, 0, 2, 1]), torch.tensor([0, 0, 2, 2]))  # class 1 predicted once, never true
    assert scores["per_class_accuracy"] == [1.0, None, 0.5]
    assert scores["AA"] == pytest.approx(0.75)  # the mean over the classes present, as sklearn's


def test_confusion_matrix_matches_sklearn_and_ignores_unlabelled(tested):
    scores, true, predicted = tested
    assert scores["confusion_matrix"].tolist() == confusion_matrix(true, predicted).tolist()
    assert scores["confusion_matrix"].tolist() == KNOWN_CONFUSION.tolist()
    assert int(scores["confusion_matrix"].sum()) == KNOWN_CONFUSION.sum()  # the -1 pixels are nowhere


@pytest.mark.parametrize("validate_args", [True, False])
def test_training_scores_equal_torchmetrics_over_batches(validate_args):
    from torchmetrics.classification import MulticlassAccuracy, MulticlassCohenKappa

    from hslite.task import TrainingScores

    classes = 5
    ours = TrainingScores(classes)
    reference = {
        "OA": MulticlassAccuracy(classes, average="micro", ignore_index=IGNORE_INDEX, validate_args=validate_args),
        "AA": MulticlassAccuracy(classes, average="macro", ignore_index=IGNORE_INDEX, validate_args=validate_args),
        "kappa": MulticlassCohenKappa(classes, ignore_index=IGNORE_INDEX, validate_args=validate_args),
    }
    generator, labelled = torch.Generator().manual_seed(0), 0
    for n in (16, 7, 1, 33):
        logits = torch.randn(n, classes, generator=generator)
        logits[:, 4] -= 10  # class 4 is never predicted ...
        target = torch.randint(0, 3, (n,), generator=generator)  # ... classes 3 and 4 never true: 3 counts (predicted)
        target[torch.rand(n, generator=generator) < 0.2] = IGNORE_INDEX
        ours.update(logits, target)
        labelled += int((target != IGNORE_INDEX).sum())
        for metric in reference.values():
            metric.update(logits, target)
    scores = ours.compute()
    for name, metric in reference.items():
        assert scores[name].item() == pytest.approx(metric.compute().item(), abs=1e-6), name
    assert int(ours.counts.sum()) == labelled  # the -1 targets are nowhere


def test_training_scores_of_nothing_match_torchmetrics():
    from hslite.task import TrainingScores

    scores = TrainingScores(3).compute()
    assert scores["OA"].item() == 0.0 and scores["AA"].item() == 0.0 and scores["kappa"].isnan()
