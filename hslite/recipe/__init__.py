"""The one layer that reads a Config: schema, build, the pre-flight gate and `parallel.plan=auto`."""
