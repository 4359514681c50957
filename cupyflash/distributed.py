"""Context parallelism: ring attention over a torch.distributed group (NCCL or gloo), with
`shard` and `gather` for the sequence layouts; the adapter itself is
cupyflash/frameworks/distributed.py. Importing this module imports torch."""

from cupyflash.frameworks.distributed import (  # noqa: F401
    ShardedAttention, allgather_attention, context_parallel, gather, ring_attention, shard,
)

__all__ = ["ring_attention", "allgather_attention", "shard", "gather", "context_parallel", "ShardedAttention"]
