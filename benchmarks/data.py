"""Data benchmark: reads per rank at world sizes 1-8, and time to the first batch at a (re)start.

    .venv/bin/python benchmarks/data.py

On the embedded corpus (default plan: K = 8 partitions, 2048-token micro-batches, windows of 1024
rows), for W = 1, 2, 4, 8, each rank streams its steps of one epoch through the block reader
(`elastic_train.data.blocks`, what a training worker runs): rows and bytes read per rank against its
share of the rows trained, and read amplification (rows read by all ranks / rows trained; before
sharded reads every rank read the whole data set: W). Then the time from a new reader to its first
step at the epoch's start and at a resume from the cursors of a step 90% into the epoch (what a
restarted worker does), and the rows that resume read; the same first step through the Ray Data
reader (`data.reader=ray_data`) on a local cluster, cold and warm. Prints one JSON line.
"""

from __future__ import annotations

import json
import time

import pyarrow.fs as pafs

from elastic_train.cluster.raydata import RayDataBlockReader
from elastic_train.data.blocks import BlockReader, iter_rank_steps
from elastic_train.data.dataset import inspect_dataset
from elastic_train.data.plan import StreamSpec, owned_partitions
from elastic_train.data.prepare import default_corpus_dir
from elastic_train.data.rowgroups import build_block_table

K, MICRO_BATCH_TOKENS, WINDOW, MAX_SEQ_LEN = 8, 2048, 1024, 512


def epoch_reads(table, spec: StreamSpec, world_size: int) -> dict:
    """Stream one epoch on every rank; rows/bytes read and rows trained per rank."""
    ranks, cursors_at = [], {}
    for rank in range(world_size):
        reader = BlockReader(table)
        trained, step = 0, 0
        for mbs, cursors in iter_rank_steps(reader, spec, partitions=owned_partitions(rank, world_size, K),
                                            epoch=0):
            if not mbs:
                break
            trained += sum(len(mb.ids) for mb in mbs)
            cursors_at.setdefault(step, {}).update(cursors)
            step += 1
        ranks.append({"rank": rank, "rows_read": reader.counter.rows, "bytes_read": reader.counter.bytes,
                      "rows_trained": trained})
    read = sum(r["rows_read"] for r in ranks)
    trained = sum(r["rows_trained"] for r in ranks)
    return {"world_size": world_size, "read_amplification": round(read / trained, 4),
            "worst_rank_read_over_share": round(max(r["rows_read"] / max(r["rows_trained"], 1)
                                                    for r in ranks), 4),
            "bytes_read_per_rank": [r["bytes_read"] for r in ranks], "_cursors": cursors_at}


def first_step_s(table, spec: StreamSpec, cursors=None, reader_class=BlockReader) -> tuple[float, int]:
    """Seconds from a new reader (rank 0 of 2) to its first step, and the rows it read for it."""
    reader = reader_class(table)
    t0 = time.perf_counter()
    next(iter_rank_steps(reader, spec, partitions=owned_partitions(0, 2, K), epoch=0, cursors=cursors))
    return time.perf_counter() - t0, reader.counter.rows


def ray_data_first_steps(table, spec: StreamSpec) -> dict:
    """The same first step through the Ray Data reader on a new local cluster: cold (its read
    tasks start worker processes) and warm (they exist), and the whole epoch of rank 0 of 2."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        cold, _ = first_step_s(table, spec, reader_class=RayDataBlockReader)
        warm, _ = first_step_s(table, spec, reader_class=RayDataBlockReader)
    finally:
        ray.shutdown()
    print(f"Ray Data reader: first step {cold:.2f} s cold, {warm:.2f} s warm")
    return {"cold": round(cold, 3), "warm": round(warm, 3)}


def main() -> None:
    info = inspect_dataset(str(default_corpus_dir(MAX_SEQ_LEN)))
    table = build_block_table(pafs.LocalFileSystem(), info.files, info.files)
    spec = StreamSpec(K, MICRO_BATCH_TOKENS, WINDOW, seed=0)
    sizes = [epoch_reads(table, spec, w) for w in (1, 2, 4, 8)]
    cursors = sizes[1].pop("_cursors")
    for s in sizes:
        s.pop("_cursors", None)
    late = sorted(cursors)[int(0.9 * len(cursors))]
    start_s, start_rows = first_step_s(table, spec)
    resume_s, resume_rows = first_step_s(table, spec, cursors[late])
    ray_data = ray_data_first_steps(table, spec)
    for s in sizes:
        print(f"W={s['world_size']}: read amplification {s['read_amplification']:.3f}, worst rank read / "
              f"its share {s['worst_rank_read_over_share']:.3f}, bytes per rank {s['bytes_read_per_rank']}")
    print(f"first step of a new reader: {start_s * 1000:.0f} ms at the epoch's start ({start_rows} rows "
          f"read), {resume_s * 1000:.0f} ms resuming at step {late} of {len(cursors)} ({resume_rows} rows)")
    print(json.dumps({"benchmark": "data", "rows": int(table.rows.sum()), "blocks": len(table),
                      "world_sizes": sizes, "first_step_s": round(start_s, 4),
                      "first_step_rows_read": start_rows, "resume_step": late,
                      "resume_first_step_s": round(resume_s, 4), "resume_rows_read": resume_rows,
                      "ray_data_first_step_s": ray_data}))


if __name__ == "__main__":
    main()
