"""The patch pipeline: patches gathered from the padded cube (a C kernel on the CPU), augmented, in reused buffers."""
