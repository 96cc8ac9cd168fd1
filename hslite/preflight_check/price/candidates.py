"""The plans worth pricing against a requested one: the same global batch on other layouts (docs/design.md)."""

from __future__ import annotations

from hslite.parallel.plan import Plan

AMP_PRECISION = "bf16-mixed"  # the AMP a single device is also priced with; fp16 on CPU runs as bf16 anyway
BATCH_SCALES = (4, 2, 1, 1 / 2, 1 / 4)  # per-device batch × scale, accumulation ÷ scale: same global batch


def _same_global_batch(plan: Plan, down_to_one: bool = False) -> list[Plan]:
    """The plan with larger or smaller micro-batches and accumulation adjusted to keep its global batch.

    `down_to_one` halves the micro-batch on, to 1: where the requested plan does not fit, the accumulation that
    makes it fit is priced before channel groups or FSDP are said to be needed.
    """
    out = []
    scales = list(BATCH_SCALES)
    while down_to_one and plan.batch_size * scales[-1] > 1:
        scales.append(scales[-1] / 2)
    for scale in scales:
        batch, accumulate = plan.batch_size * scale, plan.accumulate / scale
        if batch >= 1 and accumulate >= 1 and batch == int(batch) and accumulate == int(accumulate):
            out.append(plan.with_(batch_size=int(batch), accumulate=int(accumulate)))
    return out


def _one_device(requested: Plan) -> Plan:
    """The requested optimiser step on one device: all its micro-batches accumulated there."""
    return requested.with_(
        devices=1, num_nodes=1, chag=1, fsdp=False, compression="none", accumulate=requested.dp * requested.accumulate
    )


def largest_one_device_batch(requested: Plan) -> int:
    """The largest micro-batch of the one-device candidates of `requested` (the best of them, as a rule)."""
    return max(plan.batch_size for plan in _same_global_batch(_one_device(requested)))


def candidate_plans(
    requested: Plan,
    max_devices: int,
    *,
    chag_supported: bool = False,
    band_groups: int = 0,
    include_fsdp: bool = False,
    per_layer_across_nodes: bool = False,
    amp: bool = True,
    down_to_one: bool = False,
) -> list[Plan]:
    """Every layout worth pricing against `requested`, all at its global batch (where the sizes divide).

    One device with accumulation, and with AMP too when `amp`; the requested layout; DP at 2..max_devices devices
    per node; int8/bf16 compression; batch/accumulation trades; FSDP when `include_fsdp`; channel groups inside a
    node when `chag_supported`, in rank counts that divide the model's `band_groups` (when given). Per-layer
    communication (FSDP) crosses nodes only when `per_layer_across_nodes` (the topology's bandwidth ratio below its
    `max_cross_node_ratio`, docs/design.md, mapping); hybrid FSDP (sharded inside each node) across nodes always.
    `down_to_one` trades micro-batch for accumulation down to 1 sample (when the requested plan does not fit).
    """
    micro_batches = requested.dp * requested.accumulate  # micro-batches of `batch_size` per optimiser step
    plans: list[Plan] = [requested]
    precisions = ("32-true", AMP_PRECISION, requested.precision) if amp else (requested.precision,)
    for precision in dict.fromkeys(precisions):
        plans += _same_global_batch(_one_device(requested).with_(precision=precision), down_to_one)
    for nodes in dict.fromkeys((1, requested.num_nodes)):
        for devices in range(1, max_devices + 1):
            world = devices * nodes
            if world < 2 or requested.global_batch % world:
                continue
            # The requested micro-batches shared by the ranks; where they do not divide among them (one b64 micro-
            # batch on 2 ranks), one micro-batch per rank of the global batch, so every count that divides it is priced.
            batch, accumulate = requested.batch_size, micro_batches // world
            if micro_batches % world:
                batch, accumulate = requested.global_batch // world, 1
            base = requested.with_(
                devices=devices,
                num_nodes=nodes,
                batch_size=batch,
                chag=1,
                fsdp=False,
                compression="none",
                accumulate=accumulate,
            )
            layouts = [base] + [base.with_(compression=c) for c in ("int8", "bf16")]
            # FSDP cannot shard a rotating model (Plan refuses it): its inactive groups leave units without gradients
            if include_fsdp and not base.rotation_enabled:
                if nodes == 1 or per_layer_across_nodes:
                    layouts.append(base.with_(fsdp=True))
                if nodes > 1:  # shards inside each node: what the mapping rule keeps there
                    layouts.append(base.with_(fsdp=True, hybrid_shard=True))
            if chag_supported:  # chag ranks share a batch, so each optimiser step needs chag× the accumulation
                layouts += [
                    base.with_(chag=c, accumulate=base.accumulate * c)
                    for c in range(2, devices + 1)
                    if devices % c == 0 and not (band_groups and band_groups % c)
                ]
            for layout in layouts:
                plans += _same_global_batch(layout, down_to_one)
    return list(dict.fromkeys(plans))
