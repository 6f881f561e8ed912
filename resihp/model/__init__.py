"""The GPT-style model and its tensor-parallel shards, apart from how the runtime parallelises
it."""
