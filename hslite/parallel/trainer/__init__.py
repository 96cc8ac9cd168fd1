"""A Plan as Lightning Trainer arguments, and the callback that measures each rank's memory and bytes."""
