"""Layer 2: one Ray cluster over the allocation — bootstrap, token auth, the distributed health check."""
