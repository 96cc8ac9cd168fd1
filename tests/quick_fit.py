"""The overrides a test's short fit starts from, in one place: the tiny synthetic scene, one epoch, no bar, no map.

A test adds what it is about after them (later overrides win), e.g. `[*QUICK_FIT, NO_PREFLIGHT, "data.augment=true"]`.
"""

# train.refit=false: the quickstart refits on training + validation pixels; a test not about that trains once
QUICK_FIT = ("data.scene=synthetic_tiny", "train.max_epochs=1", "train.progress=false", "output.save_map=false",
             "train.refit=false")  # fmt: skip
NO_PREFLIGHT = "preflight.enabled=false"  # a test not about the pre-flight skips its probes
