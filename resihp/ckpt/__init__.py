"""Universal (reshardable) checkpoints: state keyed by global parameter name.

Written and read with torch.distributed.checkpoint, so a job can restart in a different parallel
layout."""
