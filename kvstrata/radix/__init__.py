"""Cold page pool, BF16 recent ring, radix prefix tree, pinning and eviction."""
