"""Price a plan from measured or stated figures: step time, communication, memory, the straggler tail."""
