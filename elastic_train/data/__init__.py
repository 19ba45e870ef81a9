"""The data path: text -> Parquet shards (prepare, sources, tokenizer, rechunk), the data set as
blocks (dataset, rowgroups), the world-size-invariant plan (plan), and each rank's stream of padded
micro-batches (blocks, batches).

May import: config. Imports no torch in plan/rowgroups (Ray Data tasks import them) and no Ray at
all: the Ray Data side of prepare and of reading lives in cluster/.
"""
