"""GPU profiles for devices that are not here: memory, peak FLOP/s, memory and host bandwidth, a source per figure.

What-if pricing (docs/design.md) reads them through `roofline.py`. Profiles are YAML files in `devices/`,
read with `yaml.safe_load`. `memory_gib` is what torch sees (a little under the datasheet's capacity); rates are dense
(no 2:4 sparsity); `fp32_tflops` is plain FP32 on the vector units, not TF32, the rate "32-true" is priced at (cuDNN
may run fp32 convolutions as TF32, so a conv-heavy "32-true" plan can run faster than priced); `bf16_tflops` is the
tensor/matrix rate with FP32 accumulate, and fp16 runs at the same rate on every profile here, so "16-mixed" uses it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from hslite.errors import ConfigError
from hslite.preflight_check.hardware.bundled import bundled_names, read_bundled

# The share of the datasheet's rates each kind of kernel attains, priced apart (roofline.py): matmuls at the tensor
# rate, convolutions at theirs, every other kernel's bytes at memory bandwidth. Matmuls are held at the datasheet's
# rate (timm's published ViT-L/32 training on an RTX 3090 runs at 68 % of its fp16 peak with its other kernels in
# it: its matmuls ran at about the peak); the other two are fitted on two rows of that table only, ResNet-50 (mostly
# convolutions) and DenseNet-121 (mostly memory traffic), and held for every model and profile:
# `benchmarks/whatif_vs_published.py` prints them and how the eight rows they were not fitted on come out.
# preflight.device_efficiency, or a profile's own figures, override them.
MATMUL_EFFICIENCY = 1.0
CONV_EFFICIENCY = 0.64
MEMORY_EFFICIENCY = 0.45
# Host time eager PyTorch spends to issue one kernel (Python, dispatcher, autograd, the CUDA launch): GPU work is
# asynchronous, so a step cannot take less than its kernels × this, the "overhead" regime of He 2022, "Making deep
# learning go brrrr from first principles" (horace.io/brrr_intro.html): a few µs of Python, dispatcher and autograd
# per op, and the launch adds a few µs of host time. An estimate, not yet calibrated on a GPU; a profile's own
# `launch_us` overrides it.
DEFAULT_LAUNCH_US = 10.0
PROFILE_PREFIX = "profile:"  # a ProbeResult.device priced from a profile, not measured (roofline.profile_probe)
_FIGURES = ("memory_gib", "memory_gbps", "fp32_tflops", "bf16_tflops", "host_gbps")


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU as its datasheet states it, with the efficiency and launch cost the roofline prices it at."""

    name: str
    device_name: str  # part of torch.cuda.get_device_name() on this GPU (which profile a GPU box measures)
    memory_gib: float  # device memory torch sees
    memory_gbps: float  # GB/s, peak memory bandwidth
    fp32_tflops: float  # dense, plain FP32 (not TF32)
    bf16_tflops: float  # dense, tensor/matrix units with FP32 accumulate; fp16 the same
    host_gbps: float  # GB/s host to device (PCIe, one direction), what a batch's copy crosses
    source: dict[str, str]  # one citation per figure
    matmul_efficiency: float = MATMUL_EFFICIENCY  # share of the peak FLOP/s matmuls attain
    conv_efficiency: float = CONV_EFFICIENCY  # share of the peak FLOP/s convolutions attain
    memory_efficiency: float = MEMORY_EFFICIENCY  # share of the memory bandwidth every other kernel attains
    launch_us: float = DEFAULT_LAUNCH_US  # host microseconds per kernel launch

    @property
    def memory_bytes(self) -> int:
        """Memory of one device."""
        return int(self.memory_gib * 2**30)

    @property
    def efficiencies(self) -> dict[str, float]:
        """The share of its rate each kind of kernel attains, by the roofline's name for the kind."""
        return {"matmul": self.matmul_efficiency, "conv": self.conv_efficiency, "memory": self.memory_efficiency}

    def with_efficiency(self, efficiency: float) -> DeviceProfile:
        """The profile with one efficiency for every kind of kernel (preflight.device_efficiency)."""
        return replace(self, matmul_efficiency=efficiency, conv_efficiency=efficiency, memory_efficiency=efficiency)

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s at a Lightning precision: plain FP32 for "32-true", the bf16/fp16 tensor rate for AMP."""
        return (self.fp32_tflops if precision == "32-true" else self.bf16_tflops) * 1e12


def list_devices() -> list[str]:
    """Names of the bundled GPU profiles."""
    return bundled_names("devices")


def load_device(name: str) -> DeviceProfile:
    """Read one bundled profile (yaml.safe_load); an unknown name raises ConfigError listing the known ones."""
    data = read_bundled("devices", name, "preflight.device")
    try:
        profile = DeviceProfile(name=name, **data)
    except TypeError as err:
        raise ConfigError(f"device file {name}.yaml is malformed ({err}); expected keys {_FIGURES}.") from err
    uncited = [f for f in _FIGURES if f not in profile.source]
    if uncited:
        raise ConfigError(f"device {name}.yaml gives {', '.join(uncited)} without a source; cite each figure.")
    return profile


@functools.cache
def launch_seconds_on(device: str) -> float:
    """Host seconds to issue one kernel on the device a probe names (`ProbeResult.device`), as the roofline prices it.

    The launch_us of the profile a what-if probe was priced from ("profile:NAME") or of the one that names a probed
    GPU ("cuda:0 (NVIDIA H100 ...)"), else DEFAULT_LAUNCH_US: on a CPU an op's dispatch costs the host the same kind
    of time, without the launch.
    """
    if device.startswith(PROFILE_PREFIX):
        return load_device(device.removeprefix(PROFILE_PREFIX)).launch_us * 1e-6
    name = device_for_gpu(device) if device.startswith("cuda") else None
    return (load_device(name).launch_us if name else DEFAULT_LAUNCH_US) * 1e-6


def device_for_gpu(gpu_name: str) -> str | None:
    """The profile of a GPU from its torch.cuda.get_device_name(), or None when none matches."""
    return next((name for name in list_devices() if load_device(name).device_name in gpu_name), None)
