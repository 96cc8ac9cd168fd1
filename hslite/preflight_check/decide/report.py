"""The pre-flight verdict as a person reads it: the ranked table, the reasons, one closing line."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from hslite.preflight_check.decide.verdict import Verdict


def print_verdict(verdict: Verdict, console: Console | None = None) -> None:
    """Table of priced plans, the reasons in words, and the decision with the better plan named."""
    console = console or Console()
    if not console.is_terminal:  # piped or logged: rich would wrap the table to 80 columns
        console = Console(width=140)
    console.print(verdict.render_table(limit=10))
    if verdict.critical_params:
        console.print(_critical_params_table(verdict.critical_params, verdict.min_efficiency))
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


def _critical_params_table(report: dict[str, Any], min_efficiency: float) -> Table:
    """P* per link as rows, with the side of it where DP pays and whether it pays for this model."""
    table = Table(
        title=f"P* per link: the model size where DP over {report['world_size']} ranks at b{report['batch_size']} "
        f"reaches E ≥ {min_efficiency:g} against one device at b{report['batch_size']} (r ≤ r*; the plan "
        f"table's E is against the best one-device plan), with this model's compute and the training loop's cost; "
        f"this model: {report['model_params'] / 1e6:.3g} M parameters"
    )
    for name in ("link", "r*", "P*", "DP pays for", "this model"):
        table.add_column(name, justify="left" if name in ("link", "DP pays for") else "right")
    for row in report["links"]:
        p_star = "—" if row["p_star"] is None else f"{row['p_star'] / 1e6:.3g} M"
        slowed = f" (ranks {row['slowdown']:.2g}× slower sharing cores)" if row["slowdown"] > 1 else ""
        table.add_row(
            row["link"] + slowed,
            f"{row['r_target']:.3g}",
            p_star,
            row["pays_for"],
            "pays" if row["pays_for_this_model"] else "does not pay",
        )
    return table
