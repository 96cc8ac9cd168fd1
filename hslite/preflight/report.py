"""The pre-flight verdict as a person reads it: the ranked table, the reasons, one closing line."""

from __future__ import annotations

from rich.console import Console

from hslite.preflight.verdict import Verdict


def print_verdict(verdict: Verdict, console: Console | None = None) -> None:
    """Table of priced plans, the reasons in words, and the decision with the better plan named."""
    console = console or Console()
    if not console.is_terminal:  # piped or logged: rich would wrap the table to 80 columns
        console = Console(width=140)
    console.print(verdict.render_table(limit=10))
    for reason in verdict.reasons:
        console.print(f"  • {reason}")
    better = ""
    if verdict.best_passing is not None and verdict.best_passing != verdict.requested:
        better = f"; better: {verdict.best_passing.describe()} ({verdict.best_passing.overrides()})"
    colour = {"GO": "green", "NO-GO": "red", "UNDECIDED": "yellow"}[verdict.decision]
    word = f"[{colour}]{verdict.decision}[/{colour}]"
    if verdict.efficiency is None:
        console.print(f"{word} {verdict.requested.describe()} (compute not measured on this box)")
        return
    source = f", compute from the {verdict.compute_profile['profile']} profile" if verdict.compute_profile else ""
    console.print(
        f"{word} {verdict.requested.describe()} (E = {verdict.efficiency:.2f}, min {verdict.min_efficiency}{source})"
        f"{better}"
    )
