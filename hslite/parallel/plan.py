"""The Plan: how one run is laid out over devices, validated before any process group exists.

A Plan is the single description of a layout that the pre-flight check prices and that `trainer_args` turns into
Lightning Trainer arguments; nothing else in hslite decides devices, precision or strategy. Plans are built from
plain arguments (`hslite.recipe.build.plan_from_config` reads a recipe into one), so this package never sees a Config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, get_args

from hslite.errors import ConfigError

Accelerator = Literal["cpu", "gpu"]
Precision = Literal["32-true", "bf16-mixed", "16-mixed"]
Compression = Literal["none", "int8", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
COMPRESSIONS: tuple[str, ...] = get_args(Compression)


@dataclass(frozen=True)
class Plan:
    """One layout of a training run over devices; an inconsistent one is refused when it is made (ConfigError).

    world_size = devices × num_nodes = dp × chag; global batch = dp × batch_size × accumulate.
    """

    devices: int = 1  # devices (GPUs, or CPU processes) per node
    num_nodes: int = 1  # nodes; more than 1 runs under a launcher (torchrun, srun: `launched.py`), hslite starts none
    accelerator: Accelerator = "cpu"  # "cpu" (gloo processes) or "gpu" (NCCL)
    batch_size: int = 64  # per-device micro-batch, samples
    accumulate: int = 1  # micro-batches per optimiser step; 1 means no accumulation
    precision: Precision = "32-true"  # Lightning precision string
    compression: Compression = "none"  # gradient all-reduce compression; "none" means plain fp32 all-reduce
    chag: int = 1  # ranks that split one sample batch's band groups; 1 means no channel parallelism
    rotation_groups: int = 0  # band groups active per step under channel-subset rotation; 0 means off
    fsdp: bool = False  # shard parameters, gradients and optimiser state across the data-parallel ranks
    # with fsdp on several nodes: shard inside each node and keep one replica per node (HSDP), so FSDP's per-layer
    # gathers stay on the link inside a node and only one all-reduce of each shard crosses (docs/design.md, mapping)
    hybrid_shard: bool = False
    tf32: bool = True  # CUDA only: fp32 matmuls and convolutions on TF32 tensor cores; False means full fp32
    cudnn_benchmark: bool = True  # CUDA only: cuDNN times its kernels for each new input shape; False means heuristics

    @property
    def world_size(self) -> int:
        """Ranks in the whole run."""
        return self.devices * self.num_nodes

    @property
    def dp(self) -> int:
        """Data-parallel replicas (ranks that see different samples)."""
        return self.world_size // self.chag

    @property
    def global_batch(self) -> int:
        """Samples per optimiser step across all ranks."""
        return self.dp * self.batch_size * self.accumulate

    @property
    def chag_enabled(self) -> bool:
        """Whether band groups are split across ranks."""
        return self.chag > 1

    @property
    def rotation_enabled(self) -> bool:
        """Whether only a subset of band groups is active per step."""
        return self.rotation_groups > 0

    @property
    def shard_ranks(self) -> int:
        """Ranks one FSDP shard group spans: a node's devices under hybrid sharding, else every data-parallel rank."""
        return self.devices if self.hybrid_shard else self.dp

    @property
    def compression_enabled(self) -> bool:
        """Whether the gradient all-reduce is compressed."""
        return self.compression != "none"

    def __post_init__(self) -> None:
        """Raise ConfigError naming every factor when the layout is inconsistent."""
        problems = []
        for name in ("devices", "num_nodes", "batch_size", "accumulate", "chag"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.accelerator not in ("cpu", "gpu"):
            problems.append(f"accelerator must be 'cpu' or 'gpu', got {self.accelerator!r}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.compression not in COMPRESSIONS:
            problems.append(f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.rotation_groups < 0:
            problems.append(f"rotation_groups must be ≥ 0 (0 means off), got {self.rotation_groups}")
        if not problems and self.world_size % self.chag:
            problems.append(
                f"dp × chag must equal devices × num_nodes: devices({self.devices}) × num_nodes({self.num_nodes}) = "
                f"{self.world_size} is not divisible by chag({self.chag})"
            )
        if not problems and self.compression_enabled and self.fsdp:
            problems.append("compression and fsdp cannot be combined: FSDP reduce-scatters gradients itself")
        if not problems and self.fsdp and self.precision == "16-mixed":
            problems.append(
                "fsdp cannot train in precision 16-mixed (Lightning's FSDP2 strategy has no fp16 loss scaler): use "
                "parallel.precision=bf16-mixed or 32-true"
            )
        if not problems and self.hybrid_shard and not self.fsdp:
            problems.append("hybrid_shard is how FSDP shards across nodes: set parallel.fsdp=true with it")
        if not problems and self.fsdp and (self.chag_enabled or self.rotation_enabled):
            problems.append(
                "fsdp cannot be combined with chag or rotation_groups: their band groups' parameters go unused on "
                "some ranks or steps, which FSDP's per-unit reduce-scatter does not allow for; choose one"
            )
        if problems:
            raise ConfigError("invalid parallel plan: " + "; ".join(problems) + ".")

    def single_device(self) -> Plan:
        """The same per-device batch and precision on one device: how evaluation and prediction run."""
        return Plan(
            accelerator=self.accelerator,
            batch_size=self.batch_size,
            precision=self.precision,
            tf32=self.tf32,
            cudnn_benchmark=self.cudnn_benchmark,
        )

    def overrides(self) -> str:
        """The `key=value` overrides that ask `hslite fit` for this plan (the fields that set the layout)."""
        return (
            f"parallel.devices={self.devices} data.batch_size={self.batch_size} parallel.accumulate={self.accumulate} "
            f"parallel.precision={self.precision} parallel.compression={self.compression} parallel.chag={self.chag} "
            f"parallel.rotation_groups={self.rotation_groups} parallel.fsdp={str(self.fsdp).lower()}"
            + (f" parallel.hybrid_shard={str(self.hybrid_shard).lower()}" if self.fsdp else "")
            + "".join(f" parallel.{name}=false" for name in ("tf32", "cudnn_benchmark") if not getattr(self, name))
        )

    def describe(self) -> str:
        """Short human label, e.g. '4×cpu dp4 b64 acc1 32-true'."""
        parts = [f"{self.world_size}×{self.accelerator}", f"dp{self.dp}"]
        if self.chag_enabled:
            parts.append(f"chag{self.chag}")
        parts += [f"b{self.batch_size}", f"acc{self.accumulate}", self.precision]
        if self.compression_enabled:
            parts.append(self.compression)
        if self.rotation_enabled:
            parts.append(f"rot{self.rotation_groups}")
        if self.fsdp:
            parts.append("hsdp" if self.hybrid_shard else "fsdp")
        return " ".join(parts)

    def with_(self, **changes: Any) -> Plan:
        """A copy with some fields changed (checked as any Plan is)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON reports."""
        return asdict(self)
