"""Gradient compression: the int8 error-feedback communication hook, its state, and the guard that relaxes it."""
