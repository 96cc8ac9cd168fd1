"""What the pre-flight measures, as plain torch-free records: one device's probe and one link's model.

`probe.py` (with its parts) and `links.py` fill them (with torch); the cost model and the verdict read them (without).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

_F = TypeVar("_F", bound="Footprint")


@dataclass(kw_only=True)
class Footprint:
    """What one rank of a model holds at `batch_size`: bytes that do not depend on the device's speed.

    Measured with the model's own tensors (`footprint.measure_footprint`); enough to price memory and communication of
    devices that are not here, whose compute cannot be measured.
    """

    batch_size: int
    precision: str
    device: str  # where the sizes were counted
    param_count: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # saved for backward, deduplicated by storage, parameters excluded
    peak_bytes: int  # max_memory_allocated on GPU; params + grads + optimiser + activations elsewhere
    tokenizer_activation_fraction: float | None = None  # share of activation bytes saved inside the tokenizer
    group_token_bytes_per_sample: int | None = None  # tokenizer output (G × D elements) per sample
    band_group_sizes: list[int] | None = None  # bands in each of the G groups (channel groups, rotation)
    group_grad_bytes: list[int] | None = None  # gradient bytes of each group's own parameters (group_parameters)
    fsdp_gathered_bytes: int | None = None  # parameter bytes whole at once under FSDP (fsdp_policy); None: no policy
    fsdp_units: int | None = None  # FSDP units, the root included: each gathers and reduce-scatters on its own

    @property
    def band_groups(self) -> int | None:
        """G, the number of band groups, when the probe knows them."""
        return len(self.band_group_sizes) if self.band_group_sizes else None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls: type[_F], data: dict[str, Any]) -> _F:
        """Inverse of `to_dict` (unknown keys are ignored so older cache files still load)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(kw_only=True)
class ProbeResult(Footprint):
    """One device's measured costs at `batch_size`: its footprint and its times (medians, per rank)."""

    forward_seconds: float  # forward + loss; on a GPU as it runs behind its batch's copy (step_timing.py)
    backward_seconds: float
    optimizer_seconds: float  # AdamW step + zero_grad
    data_seconds: float  # a batch from the datamodule's gather + copy to the device, per micro-batch
    threads: int  # torch CPU threads during the probe
    compute_c0_seconds: float  # T_c(b) ≈ c0 + c1·b, forward + backward
    compute_c1_seconds_per_sample: float
    compress_seconds_per_byte: float | None = None  # int8 quantise + dequantise kernel work per fp32 gradient byte
    chag_fraction: float | None = None  # share of forward time in the tokenizer module
    contention: float | None = None  # CPU: times slower a step runs with `contention_ranks` ranks at once
    # FSDP2's own cost on one rank (hooks, copy-in/out, DTensor dispatch) beyond the plain step; None: not measured
    fsdp_micro_overhead_seconds: float | None = None  # per micro-step, forward + backward
    fsdp_optimizer_overhead_seconds: float | None = None  # per optimiser step
    # CPU, the slowest of `contention_ranks` ranks stepping together over one gloo group (ranks_together.py): DDP's
    # [all-reducing micro-step, no_sync micro-step, optimiser step] and FSDP's [micro-step, optimiser step]
    ddp_together_seconds: list[float] | None = None
    fsdp_together_seconds: list[float] | None = None
    # channel groups of each dp × chag mesh of those ranks, by chag size: [micro-step, optimiser step], timed with
    # `chag_together_rotation` of the groups rotating (0: none)
    chag_together_seconds: dict[str, list[float]] | None = None
    chag_together_rotation: int = 0
    contention_ranks: int = 1
    # Every timed step at `batch_size` (forward + backward + optimiser), sorted: the distribution tail.py prices
    # the slowest rank from
    step_seconds_samples: list[float] | None = None


@dataclass
class LinkModel:
    """A collective's link: latency per ring step, bandwidth (nccl-tests "busbw" sense) and DDP overlap in [0, 1]."""

    alpha_seconds: float
    bandwidth_bytes_per_second: float
    overlap: float = 0.0  # share of backward under which all-reduce can hide; 0 is the no-overlap bound
    source: str = ""  # where the figures come from (measurement, or topology profile)
    points: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds) measured, if any

    @classmethod
    def no_cost(cls, source: str = "single device: no communication") -> LinkModel:
        """The link of a one-rank group: collectives are free."""
        return cls(0.0, math.inf, 0.0, source, [])

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON (infinite bandwidth is written as null)."""
        out = asdict(self)
        out["bandwidth_bytes_per_second"] = (
            None if math.isinf(self.bandwidth_bytes_per_second) else out["bandwidth_bytes_per_second"]
        )
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinkModel:
        """Inverse of `to_dict`."""
        bw = data["bandwidth_bytes_per_second"]
        return cls(
            float(data["alpha_seconds"]),
            math.inf if bw is None else float(bw),
            float(data.get("overlap", 0.0)),
            str(data.get("source", "")),
            [(int(s), float(t)) for s, t in data.get("points", [])],
        )


@dataclass(kw_only=True)
class StepCounts:
    """The work of one training step of a model, counted on this CPU: FLOPs, other kernels' bytes, kernels, input.

    For devices that are not here, whose compute is priced from a profile (`step_counts.count_step`, `roofline.py`).
    FLOPs (the convolutions' apart) and bytes are c0 + c1·b per phase, fitted on two counted batches; kernels do not
    depend on the batch.
    """

    model: str  # the model's class name
    precision: str
    forward_flops_per_sample: float  # forward + loss
    forward_flops_fixed: float  # per step whatever the batch; 0 for models whose work is all per sample
    backward_flops_per_sample: float
    backward_flops_fixed: float
    forward_kernels: int  # aten ops that launch a kernel, forward + loss
    backward_kernels: int
    optimizer_kernels: int  # AdamW (foreach, its CUDA default) step + zero_grad
    input_bytes_per_sample: int  # what one sample of the batch copies from host to device
    tokenizer_flops_fraction: float | None = None  # share of forward FLOPs in the tokenizer modules, when named
    # Of the FLOPs above, the convolutions' (the rest are matmuls): the roofline prices the two kinds apart
    forward_conv_flops_per_sample: float = 0.0
    forward_conv_flops_fixed: float = 0.0
    backward_conv_flops_per_sample: float = 0.0
    backward_conv_flops_fixed: float = 0.0
    # Bytes in and out of every other kernel (normalisations, activations, casts, reductions), read at memory speed
    forward_bytes_per_sample: float = 0.0
    forward_bytes_fixed: float = 0.0
    backward_bytes_per_sample: float = 0.0
    backward_bytes_fixed: float = 0.0
    optimizer_bytes: float = 0.0  # the optimiser step's and zero_grad's, whatever the batch

    def forward_flops(self, batch_size: int) -> float:
        """Forward + loss FLOPs at `batch_size`."""
        return self.forward_flops_fixed + self.forward_flops_per_sample * batch_size

    def backward_flops(self, batch_size: int) -> float:
        """Backward FLOPs at `batch_size`."""
        return self.backward_flops_fixed + self.backward_flops_per_sample * batch_size

    def phase_work(self, batch_size: int) -> dict[str, tuple[float, float, float, int]]:
        """(matmul FLOPs, convolution FLOPs, other kernels' bytes, kernels) of forward, backward and the optimiser."""
        b = batch_size
        forward_conv = self.forward_conv_flops_fixed + self.forward_conv_flops_per_sample * b
        backward_conv = self.backward_conv_flops_fixed + self.backward_conv_flops_per_sample * b
        return {
            "forward": (self.forward_flops(b) - forward_conv, forward_conv,
                        self.forward_bytes_fixed + self.forward_bytes_per_sample * b, self.forward_kernels),
            "backward": (self.backward_flops(b) - backward_conv, backward_conv,
                         self.backward_bytes_fixed + self.backward_bytes_per_sample * b, self.backward_kernels),
            "optimizer": (0.0, 0.0, self.optimizer_bytes, self.optimizer_kernels),
        }  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON and the cache."""
        return asdict(self)
