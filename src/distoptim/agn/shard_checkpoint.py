"""A shard's checkpoint file: every table of one parameter-server shard, on disk.

Owns: ``ps{shard}.pt`` in the checkpoint directory -- every table of the shard (its center,
rule, server-optimizer class, hyperparameters and state, counters: :meth:`Table.state
<distoptim.agn.table.Table.state>`), with the format and the cluster's ``num_ps``. It is
written to a temporary file and renamed over the old one (atomic on POSIX); a killed shard may
leave temporary files behind (``.ps{shard}.*``), which the next start removes before it loads
the file. When a shard writes it is :mod:`distoptim.agn.server`'s business.

What goes wrong says so, naming the file: a file that cannot be read (truncated, corrupt, not
a shard checkpoint) or that another cluster shape wrote (``ValueError``, at load); a write that
fails (the directory removed during the run, a full or read-only disk: ``RuntimeError``, which
the worker whose commit made the checkpoint due receives); and, with the cluster's store, a
checkpoint this shard wrote earlier in the same run that is gone when it restarts
(``RuntimeError``: the center cannot be resumed; the store's ``shard/<s>/checkpoint`` key
records each written file).
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from distoptim.agn.table import Table

__all__ = ["CHECKPOINT_FORMAT", "ShardCheckpoint"]

CHECKPOINT_FORMAT = 1


class ShardCheckpoint:
    """The checkpoint file of shard ``shard`` of ``num_ps`` in ``directory`` (created).

    ``store``: the cluster's store (its namespace), where each write is recorded, so that a
    restart of this shard in the same run can tell a lost checkpoint from none (None: not
    recorded).
    """

    def __init__(
        self, directory: str, shard: int, num_ps: int, store: dist.Store | None = None
    ) -> None:
        self.directory = directory
        self.shard = shard
        self.num_ps = num_ps
        self._store = store
        self._recorded = False
        self._lock = threading.Lock()
        os.makedirs(directory, exist_ok=True)

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"ps{self.shard}.pt")

    def remove_temporaries(self) -> list[str]:
        """Delete temporary checkpoint files a killed shard left (``.ps{shard}.*``)."""
        removed = []
        for path in glob.glob(os.path.join(self.directory, f".ps{self.shard}.*")):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
        return removed

    @property
    def _key(self) -> str:
        return f"shard/{self.shard}/checkpoint"

    def load(self) -> dict[str, dict[str, Any]]:
        """Every table's state in the file (``{}`` when there is none); ``ValueError`` when it
        cannot be read or was written by a cluster with another ``num_ps`` (or in another
        format); ``RuntimeError`` when this shard wrote one earlier in this run (the store says
        so) and it is gone."""
        path = self.path
        if not os.path.exists(path):
            store = self._store
            if store is not None and store.check([self._key]):
                raise RuntimeError(
                    f"parameter server {self.shard} restarted, but its checkpoint "
                    f"{store.get(self._key).decode()}, written earlier in this run, is gone (was "
                    "checkpoint_dir removed or emptied during the run?): its center variables "
                    "cannot be resumed"
                )
            return {}
        try:
            blob = torch.load(path, weights_only=False)
        except Exception as exc:
            raise ValueError(
                f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}): it is "
                "truncated, corrupt or not a parameter-server checkpoint. Remove it (the shard "
                "then starts afresh from the chief's seed) or use another checkpoint_dir"
            ) from exc
        if not isinstance(blob, dict) or not isinstance(blob.get("tables"), dict):
            raise ValueError(
                f"checkpoint {path} is not a parameter-server checkpoint (it holds "
                f"{type(blob).__name__}); remove it or use another checkpoint_dir"
            )
        if blob.get("format") != CHECKPOINT_FORMAT or blob.get("num_ps") != self.num_ps:
            raise ValueError(
                f"checkpoint {path} was written by a cluster with num_ps={blob.get('num_ps')} "
                f"(format {blob.get('format')}); this one has num_ps={self.num_ps}: restart "
                "with the same number of parameter servers or use another checkpoint_dir"
            )
        return dict(blob["tables"])

    def write(self, tables: Mapping[str, Table], held: Table | None = None) -> str:
        """Write ``tables`` atomically (temp file + rename); returns the path.

        Each table is written as it is now, except while a commit of table ``held`` (whose
        write lock the caller holds) makes this checkpoint: then ``held`` is written as it is
        now and the others as of their own latest checkpoint (taking their locks here could
        deadlock with their own commits). A table's newest state always wins, so a slower
        writer never replaces a newer state with an older one.
        """
        path = self.path
        fresh = {}
        for name, t in tables.items():
            if held is None or t is held:
                fresh[name] = t.state(locked=t is held)
        with self._lock:
            states = {}
            for name, t in tables.items():
                new = fresh.get(name)
                old = t.saved_state
                newer = old is None or (
                    new is not None and new["counters"]["version"] >= old["counters"]["version"]
                )
                if newer and new is not None:
                    t.saved_state = new
                if t.saved_state is None:  # not checkpointed yet and locked by its owner
                    continue
                states[name] = t.saved_state
            blob = {
                "format": CHECKPOINT_FORMAT,
                "shard": self.shard,
                "num_ps": self.num_ps,
                "tables": states,
            }
            try:
                self._write(blob, path)
            except OSError as exc:
                raise RuntimeError(
                    f"parameter server {self.shard} could not write its checkpoint {path}: {exc} "
                    "(was checkpoint_dir removed during the run, or is its disk full or "
                    "read-only?)"
                ) from exc
            if self._store is not None and not self._recorded:
                self._store.set(self._key, path)
                self._recorded = True
        return path

    def _write(self, blob: dict[str, Any], path: str) -> None:
        """``blob`` to a temporary file in the directory, then renamed to ``path``."""
        fd, tmp = tempfile.mkstemp(prefix=f".ps{self.shard}.", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(blob, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
