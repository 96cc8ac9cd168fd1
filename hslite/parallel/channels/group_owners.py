"""Which band groups each channel-group rank owns: as many groups per rank, bands balanced across ranks.

Groups aligned to spectral regions differ in size (Indian Pines in 8 groups: 17, 16, 32, 32, 24, 23, 28 and 28
bands), and a rank's tokenizer work and activations follow its bands, so the most loaded rank sets the step time and
the memory. Consecutive groups per rank would give one rank the whole NIR region (64 of 200 bands, 32 %); balanced,
no rank holds more than 52 (26 %). Shared by the forward (channel_groups.py), the rotation schedule and the
pre-flight's pricing, so what is priced is what runs. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence


def rank_groups(group_sizes: Sequence[int], ranks: int) -> list[list[int]]:
    """Each rank's band groups (sorted indices): len(group_sizes) / ranks apiece, the largest bands load kept small.

    Largest groups first, each to the rank with the fewest bands so far among those with room (the lowest rank on
    ties): Graham's longest-processing-time rule under a per-rank count, within 4/3 of the best split and the
    same on every rank. The caller checks that `ranks` divides the group count (check_divides).

    >>> rank_groups([17, 16, 32, 32, 24, 23, 28, 28], 4)
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    """
    per_rank = len(group_sizes) // ranks
    owned: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for group in sorted(range(len(group_sizes)), key=lambda g: (-group_sizes[g], g)):
        rank = min((r for r in range(ranks) if len(owned[r]) < per_rank), key=lambda r: (loads[r], r))
        owned[rank].append(group)
        loads[rank] += group_sizes[group]
    return [sorted(groups) for groups in owned]
