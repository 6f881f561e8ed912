"""Sequence-length sources, packing into micro-batches, per-micro-batch features and analytic
FLOPs."""
