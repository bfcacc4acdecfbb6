"""Shared model blocks without model knowledge: paged attention and the KV cache tensors, rope,
norms, and the CPU decode rewrite (int8 linears, fused projections)."""
