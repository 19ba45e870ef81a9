"""Held-out documents: which documents `prepare --eval-fraction F` keeps out of the training
shards, and the ids of the rows on each side.

Why whole documents: `prepare` cuts a document into rows and shuffles the rows over the row
groups, so holding out row groups (the rule for data sets without a `doc` column, see
`rowgroups.hold_out`) puts pieces of almost every held-out document into training too, and the
eval loss reads optimistic (measured: 3.86 on such rows against 4.49 on unseen files). Here a
document is held out, all its rows, when a salted hash of its number (its index in input order,
`sources.gather_rows`) and the prepare seed falls below F: a function of the document alone, so
both prepare engines agree without seeing each other's rows, and the choice does not depend on
how the documents are cut into rows or how many there are.

Ids: the training rows keep the ids the single-process prepare has always given (their
positions in `numpy.random.default_rng(seed).permutation`, 0..N-1); the held-out rows are
permuted alike among themselves and numbered after them, N..N+M-1, so an id names one row of
the two data sets together.
"""

from __future__ import annotations

import hashlib

import numpy as np

from elastic_train.config.validate import MAX_EVAL_FRACTION

EVAL_DIR = "eval"  # the held-out data set, a prepared data set of its own inside the output
_HASH_KEY = b"elastic_train.heldout"
_HASH_RANGE = float(1 << 64)


def check_fraction(fraction: float) -> None:
    """ValueError naming --eval-fraction unless 0 <= fraction < 0.5, eval.fraction's bound."""
    if not 0 <= fraction < MAX_EVAL_FRACTION:
        raise ValueError(f"--eval-fraction must be in [0, {MAX_EVAL_FRACTION}), got {fraction}")


def document_keys(count: int, seed: int) -> np.ndarray:
    """Each document's salted hash in [0, 1): blake2b of (seed, document number)."""
    keys = np.empty(count, dtype=np.float64)
    for doc in range(count):
        digest = hashlib.blake2b(f"{seed}#{doc}".encode(), digest_size=8, key=_HASH_KEY).digest()
        keys[doc] = int.from_bytes(digest, "big") / _HASH_RANGE
    return keys


def held_documents(count: int, fraction: float, seed: int) -> np.ndarray:
    """Which of `count` documents are held out (a boolean per document): those whose key is
    below `fraction`, and with a fraction above 0 at least the one of lowest key (a small
    corpus still gets an evaluation set). ValueError naming --eval-fraction when no document
    would be left for training."""
    check_fraction(fraction)
    if fraction == 0 or count == 0:
        return np.zeros(count, dtype=bool)
    keys = document_keys(count, seed)
    held = keys < fraction
    if not held.any():
        held[int(np.argmin(keys))] = True
    if held.all():
        raise ValueError(f"--eval-fraction {fraction} holds out every document ({count}) of the "
                         "input: none is left for training")
    return held


def row_ids(held_rows: np.ndarray, seed: int) -> tuple[np.ndarray, int]:
    """The id of every row (given in input order, `held_rows` saying which are held out) and
    the number of training rows N: training rows get 0..N-1, held-out rows N.., each side in
    the order of its own seeded permutation."""
    ids = np.empty(len(held_rows), dtype=np.int64)
    train = np.flatnonzero(~held_rows)
    held = np.flatnonzero(held_rows)
    ids[train[np.random.default_rng(seed).permutation(len(train))]] = np.arange(len(train))
    ids[held[np.random.default_rng(seed).permutation(len(held))]] = len(train) + np.arange(len(held))
    return ids, len(train)


def split_record(fraction: float, documents: int, rows: int, tokens: int) -> dict:
    """The `eval` section of the training set's `_prepare.json`: where the held-out set lies
    (relative to the training set), the fraction asked for, what it holds."""
    return {"path": EVAL_DIR, "fraction": fraction, "documents": documents, "rows": rows,
            "tokens": tokens}
