"""tigon.runtime: config schema, trainers, parallelism, data, checkpoints (see the runtime issue)."""
