"""FSDP2 inside each node, compression across nodes: every step over the shards, and DiLoCo over them."""
