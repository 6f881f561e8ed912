"""Performance model: profiler, micro-batch time predictor, pipeline step-time predictor."""
