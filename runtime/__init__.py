"""tigon.runtime: config schema, trainers, parallelism, data, checkpoints (docs/runtime.md, docs/architecture.md)."""
