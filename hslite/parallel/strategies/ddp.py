"""Lightning DDP as hslite runs it: deadlines per phase, fenced barriers, a compressed gradient all-reduce everywhere.

Barriers are fences over gloo with a deadline of their own (`deadlines.py`), so one rank's solo work (a checkpoint
write) cannot end a healthy job; the compression hook is registered on CPU too, where Lightning registers none.

Build them directly (no registry name): `Trainer(strategy=CompressedDDPStrategy("int8", start_method="spawn"), ...)`.
"""

from __future__ import annotations

import atexit
import gc
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from hslite.errors import ConfigError
from hslite.parallel.compression.hook import dispatch_hook
from hslite.parallel.compression.state import CompressionState
from hslite.parallel.deadlines import FencedBarrier
from hslite.parallel.wire_format import DEFAULT_CHUNK_ELEMS, check_kind

CHECKPOINT_KEY = "hslite_compression"  # top-level checkpoint entry: {"world_size": N, "ranks": [state per rank]}


def gather_from_ranks(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on rank 0 and `[]` on the others; `[value]` without several ranks.

    For what goes into a checkpoint, which rank 0 alone writes (Lightning's `Strategy.save_checkpoint`, and the
    metadata file of a sharded one): one `gather_object` to it, so that no other rank receives every rank's state
    (under int8, a residual the size of the gradients per rank). For host objects (numbers, CPU tensors): on GPUs
    they go over the group's gloo half (`trainer_args.process_group_backend`), where torch sends object collectives.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    values: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, values, dst=0)
    return values or []


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        # What still holds the group (a finished Trainer's DDP reducer, in Lightning's reference cycles) goes first,
        # so the destroy frees it while Python is alive (without: 1 run in 10 of examples/own_script aborted).
        gc.collect()
        dist.destroy_process_group()


class DestroyedAtExit:
    """Destroys the rank's process group when its interpreter exits, on every backend, while Python is still alive.

    Lightning registers that only when the backend is exactly "nccl" (`_init_dist_connection`); hslite's groups are
    "gloo" on CPUs and "cuda:nccl,cpu:gloo" on GPUs. Without it a rank exits with gloo's worker threads alive, and a
    worker that frees a tensor while the interpreter finalizes takes the GIL and aborts the rank after a successful
    run (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291; seen in CI on a 2-rank
    FSDP fit). `destroy_process_group` joins those threads.
    """

    def setup_environment(self) -> None:  # noqa: D102 - Lightning's hook; the group exists once it returns
        super().setup_environment()  # type: ignore[misc]
        atexit.unregister(_destroy_default_group)  # once, however many fits this process runs
        atexit.register(_destroy_default_group)


class FencedDDPStrategy(DestroyedAtExit, FencedBarrier, DDPStrategy):
    """Lightning's DDPStrategy with phase deadlines and fenced barriers, its group destroyed at exit.

    `deadlines=` sets the phases' deadlines (`deadlines.FencedBarrier`); `DestroyedAtExit` says why the group goes.
    """


class CompressedDDPStrategy(FencedDDPStrategy):
    """DDPStrategy whose gradient all-reduce is int8 (error feedback), bf16, fp16 or fp32, switchable at run time.

    Lightning registers `ddp_comm_hook` only when the root device is CUDA and says nothing otherwise, so this class
    registers its own hook. The override point is `configure_ddp`: in lightning 2.6.6 `DDPStrategy.setup` calls it
    only when fitting, and it wraps the module in DistributedDataParallel (`_setup_model`) then calls
    `_register_ddp_hooks`, the CUDA-only registration. Registering after `super().configure_ddp()` is the first moment
    the wrapped model exists, before any backward; it uses public API only and runs on every device type.

    DDP accepts `register_comm_hook` once per model, so the registered hook is `dispatch_hook`, which reads the kind
    from the shared `CompressionState` at each call; `set_compression` changes that kind.

    Checkpoints: every rank's state (kind, step, statistics, residuals by parameter name) is gathered into the
    checkpoint under "hslite_compression" (residuals differ per rank, and only rank 0 writes the file, so the
    checkpoint grows by world_size × the fp32 gradient size under int8); on resume each rank takes its own back.
    With hslite's `TrainingState` callback the states ride in its gather of the random states (`rank_state`,
    `put_rank_states`): one collective per checkpoint, not two.
    """

    def __init__(
        self,
        compression: str = "int8",
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        bucket_cap_mb: float = 25.0,
        **kwargs: Any,
    ) -> None:
        taken = [name for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper") if kwargs.get(name)]
        if taken:
            raise ConfigError(
                f"CompressedDDPStrategy registers its own communication hook; drop {', '.join(taken)} and choose "
                f"the compression with compression='int8'|'bf16'|'fp16'|'none'."
            )
        super().__init__(bucket_cap_mb=bucket_cap_mb, **kwargs)
        self._compression = check_kind(compression)
        self._chunk_elems = chunk_elems
        self._bucket_cap_mb = bucket_cap_mb
        self._compression_state: CompressionState | None = None

    @property
    def compression_state(self) -> CompressionState:
        """Hook state of this rank, made on first use (a checkpoint may be restored before DDP wraps the model)."""
        if self._compression_state is None:
            self._compression_state = CompressionState(self._compression, self._chunk_elems)
        return self._compression_state

    @property
    def bucket_cap_mb(self) -> float:
        """DDP bucket cap in MiB: each bucket costs two collectives under int8, so the cost model needs it."""
        return self._bucket_cap_mb

    @property
    def compression(self) -> str:
        """The compression the next gradient all-reduce uses."""
        return self.compression_state.kind

    def set_compression(self, kind: str) -> None:
        """Switch compression from the next backward on; call it on every rank at the same step."""
        self.compression_state.set_kind(kind)

    def configure_ddp(self) -> None:
        """Wrap the model in DDP as Lightning does, then register the dispatching hook on any device."""
        super().configure_ddp()
        state = self.compression_state
        ddp = self.model
        if not isinstance(ddp, DistributedDataParallel):
            raise RuntimeError(f"expected the model wrapped in DistributedDataParallel, got {type(ddp).__name__}")
        state.bind(ddp.module)
        self._register_hook(ddp, state, dispatch_hook)

    def _register_hook(self, ddp: DistributedDataParallel, state: Any, hook: Any) -> None:
        """Register DDP's one communication hook (channel groups wrap it to keep the collectives in order)."""
        ddp.register_comm_hook(state, hook)

    def rank_state(self) -> dict[str, Any]:
        """The part of a full checkpoint that is this rank's own: its compression state."""
        return self.compression_state.state_dict()

    def put_rank_states(self, checkpoint: dict[str, Any], states: list[Any]) -> None:
        """Write every rank's `rank_state`, gathered in rank order, into `checkpoint`."""
        checkpoint[CHECKPOINT_KEY] = {"world_size": len(states), "ranks": states}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Add every rank's compression state to rank 0's full checkpoint; Lightning calls this on all ranks.

        A checkpoint that carries them already (`TrainingState` gathered them with its own) is not gathered again:
        the key is there on every rank, holding no state on the others (`gather_from_ranks`), so all decide alike.
        """
        # A weights-only checkpoint carries no training state.
        if "optimizer_states" in checkpoint and CHECKPOINT_KEY not in checkpoint:
            self.put_rank_states(checkpoint, gather_from_ranks(self.rank_state()))
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint and restore this rank's compression state from it when present."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is not None:
            if saved["world_size"] == self.world_size:
                self.compression_state.load_state_dict(saved["ranks"][self.global_rank])
            else:
                rank_zero_warn(
                    f"checkpoint has compression residuals for {saved['world_size']} ranks, this run has "
                    f"{self.world_size}; keeping the saved compression kind and starting residuals from zero."
                )
                self.compression_state.load_state_dict(saved["ranks"][0] | {"residuals": {}})
        return checkpoint
