"""Measure this box: one training step timed and sized, the loop around it, ranks stepping together."""
