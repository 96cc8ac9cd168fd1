"""hslite: single-node hyperspectral training that measures whether more GPUs pay before it uses them."""

__version__ = "0.1.0"
