"""The one layer that reads a Config: schema, ranges, build, the pre-flight gate and `parallel.plan=auto`."""
