"""The shipped recipes, one YAML file each; installed as the package `hslite.recipes` (pyproject's package-dir).

This file makes the folder a regular package: setuptools' editable finder cannot import a mapped folder without one.
"""
