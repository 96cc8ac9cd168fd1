"""A team's own Lightning script, checked before it trains: `check.preflight_module`, and `callback.PreflightGate`."""
