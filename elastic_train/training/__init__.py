"""The training step and loop: build (model, optimizer, restore), step (forward/backward, the
exact or DDP reduction, optimizer), evaluate, the loop itself; and what they use: models (model,
hf), losses, optim, commhooks, checkpoint, watchdog.

May import: config, data. Imports no Ray: everything from outside comes through `env.WorkerEnv`.
"""
