"""The Lightning strategies hslite runs: DDP with a fenced barrier and optional compression, and FSDP2."""
