"""The ``--out`` folder, claimed by one command at a time.

Owns: claiming a command's output folder before anything is written to it, so that two
commands started together with the same ``--out`` cannot both write there -- the second one
is refused with one line naming the first (its pid), instead of both passing the "old results
in it?" check and one of the two ``results.json`` silently replacing the other.

The claim is an exclusive ``flock`` on the folder itself, taken before the old-results check
(so the check and the claim are one atomic step) and held until the command ends
(:func:`release`, or the process exits, whatever way: the kernel drops it, so a killed command
never leaves a stale claim behind and no file is left in the folder). Linux and the BSDs
(``flock``); where the folder's file system ignores ``flock`` (some network file systems) the
claim is only as good as the old-results check.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

__all__ = ["FolderInUseError", "claim", "release"]

_CLAIMS: dict[str, int] = {}  # folder -> the open descriptor that holds its flock


class FolderInUseError(ValueError):
    """Another command holds the folder, or it cannot be claimed; the message says which."""


def claim(path: str, shown: str, overwrite: bool, results_name: str) -> None:
    """Create ``path`` if needed and claim it for this process (module doc).

    Refused (:class:`FolderInUseError`, one line naming ``--out shown``): another command
    holds it now; it already holds ``results_name`` and not ``overwrite``; it cannot be created
    or written. Claiming a folder this process holds already does nothing.
    """
    path = os.path.abspath(path)
    if path in _CLAIMS:
        return
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise FolderInUseError(f"--out {shown!r}: cannot create it ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _holder(path)
        raise FolderInUseError(
            f"--out {shown!r} is taken by another distoptim command running now"
            f"{f' (pid {holder})' if holder else ''}: it writes its results there; give this "
            "one another folder"
        ) from None
    except OSError:  # a file system without flock: the check below is all there is
        pass
    refusal = None
    if os.path.exists(os.path.join(path, results_name)) and not overwrite:
        refusal = (
            f"--out {shown!r} already holds results of an earlier run; give another folder, "
            "or --overwrite to replace them"
        )
    elif not os.access(path, os.W_OK):
        refusal = f"--out {shown!r} is not writable"
    if refusal is not None:
        os.close(fd)
        raise FolderInUseError(refusal)
    _CLAIMS[path] = fd


def release() -> None:
    """Give up every folder this process claimed (at the end of a command)."""
    while _CLAIMS:
        _, fd = _CLAIMS.popitem()
        with contextlib.suppress(OSError):
            os.close(fd)


def _holder(path: str) -> int | None:
    """The pid holding ``path``'s flock, from ``/proc/locks`` (Linux; None elsewhere)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2e:5678 0 EOF" ("->" marks a waiter)
        if "FLOCK" in fields and "->" not in fields and inode in fields:
            with contextlib.suppress(ValueError, IndexError):
                return int(fields[fields.index(inode) - 1])
    return None
