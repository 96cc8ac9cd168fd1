"""Pre-flight check: measure one device and the links, price every candidate plan, decide GO / NO-GO.

Entry point: `hslite.preflight_check.run.run_preflight`, which takes a Plan and plain callables (probe, links, loop
cost); the Config is read above this package, in `hslite.recipe.gate`.
"""
