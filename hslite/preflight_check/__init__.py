"""Pre-flight check: measure one device and the links, price every candidate plan, decide GO / NO-GO.

In stages, each importing only the ones before it (tests/test_layout.py checks the order):

- `measurements.py`: the records the stages hand each other (a probe, a footprint, a link, counted work).
- `measure/`: this box's training step, timed and sized (the probe, the loop's own cost, ranks stepping together),
  or counted on fake tensors for a GPU that is not here.
- `hardware/`: the devices and the links between them, measured here or read from a bundled profile.
- `price/`: each plan's step time, memory and ECD from those figures (docs/design.md has the formulas).
- `decide/`: every candidate priced, the verdict and its report; `decide/check_plans.run_preflight` is the entry
  point, taking a Plan and plain callables (probe, links, loop cost); a recipe's Config is read above this package,
  in `hslite.recipe.gate`.
- `own_script/`: the same check for a team's own LightningModule and Trainer (`hslite.PreflightGate`).
"""
