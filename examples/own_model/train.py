"""Your own model through hslite's recipes, from Python: register the class, then fit and map as any recipe does.

    python examples/own_model/train.py                        # the quickstart scene, ~30 s on 2 CPU cores
    python examples/own_model/train.py train.max_epochs=3 output.root=/tmp/runs   # key=value as on the CLI

Installed as a package instead (`pip install -e examples/own_model`), the model needs no `register` call: its
`hslite.models` entry point puts it in `hslite models`, and `hslite fit model.name=spectral_mlp` trains it.
"""

import sys
from pathlib import Path

import hslite

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spectral_mlp.py, beside this script
from spectral_mlp import SpectralMLP  # noqa: E402


def main(overrides: list[str]) -> None:
    """Register the model, train the quickstart recipe with it, print its scores and map the scene."""
    hslite.register_model("spectral_mlp", SpectralMLP)
    run = hslite.fit("quickstart", ["model.name=spectral_mlp", "train.max_epochs=40", "train.lr=0.003", *overrides])
    print(f"OA {run.metrics['OA']:.2%}, kappa {run.metrics['kappa']:.3f}; best weights: {run.best_checkpoint}")
    mapped = hslite.predict(run.run_dir, overrides={"progress": False})
    print(f"map of {mapped.classes.size} pixels in {mapped.out_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
