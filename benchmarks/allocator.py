"""Evaluation throughput of the Salinas-A 3-D CNN with glibc's default allocator and with freed memory kept.

    python benchmarks/allocator.py                 # ~30 s on 2 cores
    python benchmarks/allocator.py --seconds 0.3   # a quick pass

Each setting runs in a fresh process (mallopt is process-wide): the model of the salinas_a_1gpu recipe (cnn3d on 20
components) evaluates random 7×7 and 9×9 patches at batches of 64 to 2048; the table shows samples/s side by side and
the last line the ratio at the largest batch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

BATCHES = (64, 256, 1024, 2048)


def _measure(keep: bool, patch: int, seconds: float) -> dict[str, float]:
    import torch

    from hslite.models import get_model
    from hslite.process.allocator import keep_freed_memory

    if keep:
        keep_freed_memory()
    torch.manual_seed(0)
    model = get_model("cnn3d", in_bands=20, patch_size=patch, num_classes=6).eval()
    x = torch.randn(max(BATCHES), 20, patch, patch)
    out = {}
    with torch.inference_mode():
        for b in BATCHES:
            model(x[:b])
            done, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                for i in range(0, len(x), b):
                    done += len(model(x[i : i + b]))
            out[str(b)] = done / (time.perf_counter() - start)
    return out


def main() -> int:
    """Run both settings in child processes and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="timing window per batch size")
    parser.add_argument("--child", nargs=2, metavar=("KEEP", "PATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child[0] == "1", int(args.child[1]), args.seconds)))
        return 0
    print(f"{'patch':>5} {'batch':>6} {'default samples/s':>18} {'kept samples/s':>15} {'ratio':>6}")
    ratio = 0.0
    for patch in (7, 9):
        runs = []
        for keep in ("0", "1"):
            command = [sys.executable, __file__, "--seconds", str(args.seconds), "--child", keep, str(patch)]
            runs.append(json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout))
        for b in BATCHES:
            ratio = runs[1][str(b)] / runs[0][str(b)]
            print(f"{patch:>5} {b:>6} {runs[0][str(b)]:>18.0f} {runs[1][str(b)]:>15.0f} {ratio:>6.2f}")
    print(f"kept / default at batch {max(BATCHES)}, 9x9: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
