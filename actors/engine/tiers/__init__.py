"""KV tiers below the GPU's paged cache: CPU DRAM, local disk, (part B) a shared store."""
