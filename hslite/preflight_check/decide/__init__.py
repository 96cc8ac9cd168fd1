"""Decide: price every candidate plan, pick GO / NO-GO / UNDECIDED with reasons, report the table."""
