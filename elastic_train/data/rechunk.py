"""Re-chunk a data set that is already tokenized (e.g. Parquet written by another tool, with a few
huge row groups) into row groups of `rows_per_block` rows, the unit a training rank reads alone.

`elastic-train prepare FOLDER --output NEW --rows-per-block N`, where FOLDER holds Parquet shards
with `id`, `tokens` and `length` columns (and no text column), lands here: every column and every
id is kept, one output shard per input shard, streamed a record batch at a time (bounded memory).
A held-out set that `prepare --eval-fraction` wrote beside the shards (`eval/`) is re-chunked too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_train.data.dataset import STATS_FILE, TOKENIZER_DIR, inspect_dataset, pending_marker
from elastic_train.data.heldout import EVAL_DIR
from elastic_train.data.rowgroups import auto_rows_per_block


def is_token_dataset(inputs, text_field: str) -> bool:
    """One input, a local folder (or file) of Parquet with id/tokens/length and no text column."""
    if len(inputs) != 1:
        return False
    path = Path(inputs[0])
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files or not all(f.suffix == ".parquet" and f.is_file() for f in files):
        return False
    names = pq.read_schema(files[0]).names
    return {"id", "tokens", "length"} <= set(names) and text_field not in names


def check_rechunk(source: str | Path, *, tokenizer, seed: int | None, max_seq_len: int | None,
                  eval_fraction: float | None) -> None:
    """Refuse what a re-chunk would silently not do: a folder holding text files beside its
    shards (re-chunking would skip them), a tokenizer, a seed (rows keep their tokens, ids and
    order), a max_seq_len shorter than the rows (they are kept whole), a held-out fraction
    other than the source's split (a source without one keeps none). ValueError naming each;
    None: not given (the CLI gives only what its user typed for a re-chunk)."""
    from elastic_train.data.sources import files_under

    folder = Path(source)
    if folder.is_dir():
        beside = [file for file in files_under(folder)
                  if not (file.parent == folder and file.suffix.lower() == ".parquet")
                  and file.relative_to(folder).parts[0] not in (EVAL_DIR, TOKENIZER_DIR)]
        if beside:
            raise ValueError(f"input '{source}' holds both prepared shards (id, tokens, length) "
                             f"and files to tokenize ('{beside[0]}'{', ...' if beside[1:] else ''})"
                             ": prepare the new files from a folder of their own")
    info = inspect_dataset(str(source))
    split = info.eval_split["fraction"] if info.eval_split else 0.0
    longest = max(info.max_length, inspect_dataset(info.eval_split["path"]).max_length
                  if info.eval_split else 0)
    refused = [f"--tokenizer '{tokenizer}'" if tokenizer is not None else "",
               f"--seed {seed} (rows keep their ids and order)" if seed else "",
               f"--max-seq-len {max_seq_len} (rows of up to {longest} tokens are kept whole)"
               if max_seq_len is not None and max_seq_len < longest else "",
               f"--eval-fraction {eval_fraction} (" + (
                   f"the held-out split of {split} is kept)" if split else
                   "it has no held-out split, and none is made)")
               if eval_fraction is not None and eval_fraction != split else ""]
    if any(refused):
        raise ValueError(f"input '{source}' is tokenized already, so prepare only re-chunks it "
                         f"(new row groups, --rows-per-block): it would not honour "
                         f"{', '.join(item for item in refused if item)}; leave them out, or "
                         "prepare the original text again")


def rechunk(source: str | Path, output: str | Path, rows_per_block: int | None) -> dict:
    """Write `source`'s shards again with row groups of `rows_per_block` rows (None:
    `prepare.auto_rows_per_block` of the training rows, the held-out set alike); the stats."""
    info = inspect_dataset(str(source))
    rows_per_block = rows_per_block or auto_rows_per_block(info.rows)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    with pending_marker(pafs.LocalFileSystem(), str(out)):
        tokens = 0
        max_token_id = -1
        for i, file in enumerate(info.files):
            pf = pq.ParquetFile(file)
            with pq.ParquetWriter(out / f"part-{i:05d}.parquet", pf.schema_arrow) as writer:
                for batch in pf.iter_batches(batch_size=max(rows_per_block, 1024)):
                    writer.write_batch(batch, row_group_size=rows_per_block)
                    tokens += int(pc.sum(batch.column("length")).as_py() or 0)
                    flat = pc.list_flatten(batch.column("tokens"))
                    if len(flat):
                        max_token_id = max(max_token_id, int(pc.max(flat).as_py()))
        recorded = {}
        stats_path = Path(info.path) / STATS_FILE
        if stats_path.is_file():
            recorded = json.loads(stats_path.read_text())
        if (Path(info.path) / TOKENIZER_DIR).is_dir():
            shutil.copytree(Path(info.path) / TOKENIZER_DIR, out / TOKENIZER_DIR)
        if info.eval_split is not None:  # the held-out set goes along, re-chunked alike
            rechunk(info.eval_split["path"], out / recorded["eval"]["path"], rows_per_block)
        stats = {**recorded, "rows": info.rows, "tokens": tokens, "shards": len(info.files),
                 "max_token_id": max_token_id, "rows_per_block": rows_per_block,
                 "rechunked_from": str(info.path)}
        (out / STATS_FILE).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats
