"""Scenes, readers, preprocessing and patch datasets.

Import what you need from the submodules (`hslite.datasets.scenes.registry`, `.settings`, `.preprocess`, `.splits`,
`.batches.patches`, `.datamodule`); the data module is not imported here because Lightning is slow to import.
"""
