"""What hslite sets in a process it owns (glibc's allocator), and what a library call gives back to its caller."""
