"""Channel parallelism: fixed channel groups (D-CHAG style) and channel-subset rotation."""
