"""Secrets in URIs. pyarrow takes a store's keys in its URI (`s3://KEY:SECRET@bucket/runs?...`,
the way a MinIO or Ceph user names one), a tracking server or database its password
(`postgresql://user:PASSWORD@host/db`). Such a secret is never written where others read: not in
a run folder's files (config.yaml, summary.json, events: a bucket's readers are not its
writers), nor in a checkpoint, a tracking service's params, an export, the console or ray.log.
`shown` masks it there (`KEY:***@`): the key's name stays, so a reader sees which one ran.

A URI read back from those files (an export's config.yaml names the data set and the base
model) is opened with the secret of a URI given to that command with the same key
(`with_keys`): the run folder's, `s3://KEY:SECRET@bucket/runs/name`. Without one the masked
userinfo is dropped, and the store's default credentials (environment, profile) apply. A resume
compares configs as shown, so new keys for the same store (rotated, or short-lived) are no
change to the run."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

MASK = "***"
# scheme://user:secret@ : the secret ends at the '@' (in a URI a '/', '?', '#' or '@' in it is
# percent-encoded, as pyarrow requires)
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^\s/?#@:]*):([^\s/?#@]+)@")


def shown(text: str | None) -> str | None:
    """`text` with the secret of every URI in it masked."""
    if not text or "@" not in text:
        return text
    return _USERINFO.sub(lambda m: f"{m[1]}{m[2]}:{MASK}@", text)


def shown_tree(tree: Any) -> Any:
    """A config tree (dicts, lists, strings) with every string `shown`."""
    if isinstance(tree, str):
        return shown(tree)
    if isinstance(tree, dict):
        return {key: shown_tree(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(shown_tree(value) for value in tree)
    return tree


class MaskedLog(logging.Filter):
    """On a logger: its records' messages `shown`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = shown(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def mask_logs(*names: str) -> None:
    """Mask the messages of the loggers `names` (a filter on a logger sees its own records, not
    those of the loggers below it)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, MaskedLog) for f in logger.filters):
            logger.addFilter(MaskedLog())


def with_keys(uri: str | None, given: Iterable[str]) -> str | None:
    """`uri` as read back from a run's files, ready to open: a masked secret is the one of a
    URI in `given` with the same key, or gone (the store's default credentials) where none has
    it."""
    if uri is None or f":{MASK}@" not in uri:
        return uri
    secrets = {m[2]: m[3] for text in given for m in _USERINFO.finditer(text) if m[3] != MASK}

    def fill(m: re.Match) -> str:
        if m[3] != MASK:
            return m[0]
        return f"{m[1]}{m[2]}:{secrets[m[2]]}@" if m[2] in secrets else m[1]

    return _USERINFO.sub(fill, uri)
