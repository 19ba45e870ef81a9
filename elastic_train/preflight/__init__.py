"""What the driver checks before any worker starts: inputs (data set, model, fit, storage, GPU,
sample ids), resume (checkpoint, data identity, provenance), the reduction. One ConfigError each.

May import: config, data, training (models on the meta device, checkpoint format), observe.
Imports no Ray.
"""
