"""Shared-memory segments: the on-disk header, file primitives, the producer pool, the consumer map cache."""
