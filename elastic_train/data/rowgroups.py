"""Parquet row groups as blocks: the table of a data set's blocks, and reading one block.

Only pyarrow and numpy here (no torch): Ray Data's read tasks (`blocks.RayDataBlockReader`) import
this module in fresh worker processes, and a light import is most of their start-up.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

# Rows per Parquet row group that prepare writes: the unit a training rank reads alone
# (blocks.py). Small enough that every data partition gets many, large enough that a footer
# stays small.
ROWS_PER_BLOCK = 128
# Without --rows-per-block a data set gets at least this many row groups when it has the rows
# (`auto_rows_per_block`): a run deals at least 2 blocks to each of its data partitions
# (blocks.check_blocks), and the default config has 8, so a small corpus still trains as it is.
TARGET_BLOCKS = 64


def auto_rows_per_block(rows: int) -> int:
    """Rows per row group for a data set of `rows` rows when none is asked for: ROWS_PER_BLOCK,
    fewer when that would leave under TARGET_BLOCKS row groups (down to 1 row a group)."""
    return max(1, min(ROWS_PER_BLOCK, rows // TARGET_BLOCKS))


@dataclass(frozen=True)
class BlockTable:
    """Every block of a data set: shard file, row group, rows, tokens. `files` name the shards
    (a local path, or a URI without its options: what errors show); a remote data set's workers
    open `paths` in `filesystem`, the one the data set was found in, options and all (an S3
    store's endpoint_override, region and keys: a URI rebuilt from the path alone would send them
    to AWS)."""

    files: tuple[str, ...]
    file_index: np.ndarray
    row_group: np.ndarray
    rows: np.ndarray
    tokens: np.ndarray
    filesystem: pafs.FileSystem | None = None  # None: `files` are local paths
    paths: tuple[str, ...] = ()  # the shards inside `filesystem`

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, blocks: np.ndarray) -> BlockTable:
        """A table of only `blocks` (indices into this one), in that order."""
        blocks = np.asarray(blocks, dtype=np.int64)
        return BlockTable(self.files, self.file_index[blocks], self.row_group[blocks],
                          self.rows[blocks], self.tokens[blocks], self.filesystem, self.paths)


def hold_out(table: BlockTable, fraction: float) -> tuple[BlockTable, BlockTable]:
    """(training blocks, held-out blocks): the round(fraction x blocks) blocks (at least one) of
    lowest salted hash of (shard file name, row group). Whole blocks, so each stays one read; a
    hash of what a block is, not where it lies in the table nor the data seed, so the held-out
    rows stay the same when shards are listed in another order or the seed changes, and the
    choice owes nothing to the partition deal (plan.assign_blocks)."""
    names = [uri.rsplit("/", 1)[-1] for uri in table.files]
    keys = [int.from_bytes(hashlib.blake2b(f"{names[f]}#{g}".encode(), digest_size=8,
                                           key=b"elastic_train.eval").digest(), "big")
            for f, g in zip(table.file_index.tolist(), table.row_group.tolist(), strict=True)]
    count = max(1, round(fraction * len(table)))
    held = np.sort(np.argsort(np.array(keys, dtype=np.uint64), kind="stable")[:count])
    kept = np.setdiff1d(np.arange(len(table)), held)
    return table.subset(kept), table.subset(held)


def _row_group_tokens(meta: pq.RowGroupMetaData, rows: int) -> int:
    """Tokens of a row group from metadata: the `tokens` column's uncompressed values over their
    width (an estimate within the size of the list offsets, good enough to balance by)."""
    for i in range(meta.num_columns):
        column = meta.column(i)
        if column.path_in_schema.split(".")[0] == "tokens":
            width = 4 if column.physical_type == "INT32" else 8 if column.physical_type == "INT64" else 2
            return max(int(column.total_uncompressed_size) // width, rows)
    return rows


def build_block_table(filesystem: pafs.FileSystem, files: list[str], uris: list[str]) -> BlockTable:
    """The blocks of shards `files` (paths inside `filesystem`; `uris` as workers open them),
    from the Parquet footers only."""
    index, groups, rows, tokens = [], [], [], []
    for i, path in enumerate(files):
        with filesystem.open_input_file(path) as handle:
            meta = pq.ParquetFile(handle).metadata
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if n:
                index.append(i)
                groups.append(g)
                rows.append(n)
                tokens.append(_row_group_tokens(meta.row_group(g), n))
    as_array = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    local = isinstance(filesystem, pafs.LocalFileSystem)
    return BlockTable(tuple(uris), as_array(index), as_array(groups), as_array(rows),
                      as_array(tokens), None if local else filesystem, () if local else tuple(files))


def read_row_group(table: BlockTable, block: int, columns: list[str],
                   cache: dict[int, pq.ParquetFile] | None = None) -> tuple[pa.Table, int]:
    """One block's rows (the `columns` asked for) and the compressed bytes read for them."""
    i = int(table.file_index[block])
    pf = (cache or {}).get(i)
    if pf is None:
        if table.filesystem is None:
            pf = pq.ParquetFile(table.files[i])
        else:
            pf = pq.ParquetFile(table.filesystem.open_input_file(table.paths[i]))
        if cache is not None:
            cache[i] = pf
    group = int(table.row_group[block])
    meta = pf.metadata.row_group(group)
    nbytes = sum(meta.column(c).total_compressed_size for c in range(meta.num_columns)
                 if meta.column(c).path_in_schema.split(".")[0] in columns)
    return pf.read_row_group(group, columns=columns), nbytes


class DataError(ValueError):
    """A row of the data set that cannot be trained on; the message names file, row and id."""


def check_block_rows(rows: pa.Table, table: BlockTable, block: int, vocab_rows: int | None) -> None:
    """Each row's `length` equals its token count and the length of every other list column
    (a `loss_mask`: one value per token), and its token ids lie in [0, vocab_rows): checked on
    the decoded Arrow arrays (vectorised, about a millisecond per million tokens); the slow
    description of the first bad row runs only when there is one."""
    import pyarrow.compute as pc

    ok = True
    for name in _list_columns(rows):
        counts = pc.list_value_length(rows.column(name))
        ok = ok and not pc.any(pc.not_equal(counts, pc.cast(rows.column("length"),
                                                            counts.type))).as_py()
    tokens = rows.column("tokens")
    flat = pc.list_flatten(tokens)
    if ok and len(flat):
        low, high = pc.min(flat).as_py(), pc.max(flat).as_py()
        ok = low >= 0 and (vocab_rows is None or high < vocab_rows)
    if not ok:
        raise DataError(_describe_bad_row(rows, table, block, vocab_rows))


def _list_columns(rows: pa.Table) -> list[str]:
    """`tokens`, then the other columns holding a list per row."""
    return ["tokens", *(f.name for f in rows.schema if f.name != "tokens"
                        and (pa.types.is_list(f.type) or pa.types.is_large_list(f.type)))]


def _describe_bad_row(rows: pa.Table, table: BlockTable, block: int, vocab_rows: int | None) -> str:
    tokens = rows.column("tokens").to_pylist()
    lists = {name: rows.column(name).to_pylist() for name in _list_columns(rows)[1:]}
    for i, (ids, length, row_id) in enumerate(zip(tokens, rows.column("length").to_pylist(),
                                                  rows.column("id").to_pylist(), strict=True)):
        where = (f"data file '{table.files[int(table.file_index[block])]}', row group "
                 f"{int(table.row_group[block])}, row {i} (id {row_id})")
        if len(ids) != length:
            return f"{where}: its length column says {length} but it has {len(ids)} tokens"
        for name, values in lists.items():
            if values[i] is not None and len(values[i]) != length:
                return (f"{where}: its column '{name}' holds {len(values[i])} values for its "
                        f"{length} tokens (one per token)")
        bad = [t for t in ids if t < 0 or (vocab_rows is not None and t >= vocab_rows)]
        if bad:
            return (f"{where}: token id {bad[0]} is outside the model's vocabulary of {vocab_rows} "
                    "(embedding rows)" if vocab_rows is not None else f"{where}: negative token id {bad[0]}")
    return f"data file '{table.files[int(table.file_index[block])]}': a bad row"
