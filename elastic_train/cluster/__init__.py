"""Ray: the one wing that imports it. The driver's trainer and Ray start-up (driver), the worker's
seam (worker: `RayWorkerEnv`, with its test hooks in faulthooks and its checkpoints ahead of a
resize in resizerequests), the run folder's writer actor (runlog) and Ray metrics (raymetrics),
elastic resizes (nodewatch), the console's routing of Ray's logs (console), CPU
priorities on a local cluster (cpushare), in place's torchft backend (inplace_ray), the Ray Data
prepare (prepare_ray) and block reader (raydata), and every reach into Ray's private code
(raycompat, nodewatch, inplace_ray, driver.Trainer), each naming the Ray version it was read from.

May import every other wing; none imports it (only api.py and cli.py, above it).
"""
