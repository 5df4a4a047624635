"""The one place distoptim touches torchft beyond its documented API, pinned by a test.

torchft's :class:`~torchft.manager.Manager` documents ``start_quorum``, ``allreduce``,
``should_commit``, ``num_participants``, ``participating_rank``, ``register_state_dict_fn`` and
``report_error``. Two things distoptim needs are not in that list, and both live here so that a
torchft upgrade that moves them breaks one small module and its test
(``tests/ft/test_torchft_pins.py``), not the optimizers:

* the quorum's process group (``Manager._pg``, the reconfigurable wrapper the user passed as
  ``pg=``) and this replica's rank and size in it (its ``parent`` process group) -- needed by the
  collectives that are not a plain all-reduce (all-gather, all-to-all of the lossy wire
  formats), in which every member of the quorum, healing ones included, takes part;
* whether the manager is healing in the current quorum (``Manager._healing``), so a replica
  that is about to receive a peer's state contributes nothing to this step's mean;
* the future of the quorum in progress (``Manager._quorum_future``), so a replica can wait for
  it in slices and say why it does not come (``wait_quorum()`` takes no timeout);
* whether the quorum runs on the manager's own thread (``Manager._use_async_quorum``): only
  then can a round hold the state reads of a donor's quorum past the caller's backward;
* the keys the manager writes in its replica group's store (``group_store_keys``), which a
  group restarted on the same store must clear first;
* dropping the quorum's process group after one of its collectives failed
  (``close_quorum_group``: ``ProcessGroupWrapper.abort()``, which torchft calls itself before
  it configures the next quorum's group).

``TORCHFT_VERSION`` is the version these were read from (``pyproject.toml`` pins it).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import warnings
from typing import Any

__all__ = [
    "TORCHFT_VERSION",
    "MissingExtraError",
    "close_quorum_group",
    "group_store_keys",
    "is_healing",
    "quorum_future",
    "min_replica_size",
    "quorum_id",
    "quorum_timeout_seconds",
    "quorum_group",
    "quorum_rank_and_size",
    "quiet",
    "require",
    "uses_async_quorum",
]

TORCHFT_VERSION = "0.2.0"
"""The torchft release the pinned internals were read from and tested with."""


class MissingExtraError(ImportError):
    """torchft is not installed; the message names the extra that installs it."""


def require(module: str = "torchft") -> Any:
    """``module`` of torchft (imported), or :class:`MissingExtraError` naming ``distoptim[ft]``."""
    # torchft's Rust side logs every quorum at INFO unless told otherwise before it loads
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            "fault tolerance (manager=..., distoptim.ft, --fault-tolerant) needs torchft: "
            'pip install "distoptim[ft]"'
        ) from exc


def quorum_group(manager: Any) -> Any:
    """The reconfigurable process group of ``manager``'s quorum (the ``pg=`` it was built with)."""
    return manager._pg


def close_quorum_group(manager: Any) -> None:
    """Drop the current quorum's process group now, as torchft does before it configures the
    next quorum's (``ProcessGroupWrapper.abort()``: the wrapper lets go of its group and aborts
    it where the backend can, NCCL). A gloo group closes its connections when it is freed, so
    the members still blocked in a collective with this replica fail at once instead of at
    the collective timeout. The manager issues nothing on the group until it configures a new
    one: it skips every collective of a round that recorded an error, and a failed commit
    gives the next quorum a new id, so a new group (``Manager._async_quorum``). The group is
    let go on a thread of its own: freeing a gloo group joins its worker threads, which a
    collective still blocked in it holds until its timeout."""
    wrapper = manager._pg
    abort = getattr(wrapper, "abort", None)
    if abort is None:
        return
    group = getattr(wrapper, "_pg", None)  # the wrapped process group, freed below
    abort()
    if group is not None:  # freeing it joins its worker threads: off the training thread
        holder = [group]
        del group
        threading.Thread(target=_free, args=(holder,), daemon=True).start()


def _free(holder: list[Any]) -> None:
    holder.clear()  # the last reference, if nothing else holds the group


def quorum_rank_and_size(manager: Any) -> tuple[int, int]:
    """This replica's rank in the current quorum's process group and that group's size.

    Every replica of the quorum is a member, participating or healing. Call after the quorum
    is ready (``manager.wait_quorum()``).
    """
    inner = manager._pg.parent
    return inner.rank(), inner.size()


def quorum_future(manager: Any) -> Any:
    """The ``concurrent.futures.Future`` of ``manager``'s quorum in progress (after
    ``start_quorum()``); ``manager.wait_quorum()`` waits for the same future."""
    return manager._quorum_future


def is_healing(manager: Any) -> bool:
    """Whether ``manager`` receives a peer's state in the current quorum (not yet applied)."""
    return bool(manager._healing)


def quiet() -> None:
    """Keep torchft's per-quorum chatter out of the user's terminal.

    distoptim reports the failures it acts on (a step not committed, a heal) itself.

    torchft logs every reconfiguration at WARNING ("Unable to reset NCCL flight recorder ..."
    on a CPU build) and every quorum at INFO; distoptim reports quorums and heals itself.
    """
    for name in ("torchft", "torchft.manager", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # a received checkpoint is read from a read-only buffer; torch warns once per process
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def advertised_http_transport(host: str, timeout: Any) -> Any:
    """torchft's HTTP checkpoint transport, advertising ``host`` instead of the host name.

    torchft's ``HTTPTransport.address()`` names the server by ``socket.gethostname()``, which on
    hosts that share a name (network namespaces, containers) or whose name resolves to a
    loopback address points a joiner at the wrong machine. The server itself listens on every
    interface; only the advertised address changes (``_server`` is its listening socket).
    """
    http = require("torchft.checkpointing.http_transport")

    class _Advertised(http.HTTPTransport):  # type: ignore[misc, name-defined]
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            shown = f"[{host}]" if ":" in host else host
            return f"http://{shown}:{port}/checkpoint/"

    transport = _Advertised(timeout=timeout, num_chunks=0)
    # http.server logs every request (each heal's GET) to stderr: not the user's business
    transport._server.RequestHandlerClass.log_message = lambda *args: None
    return transport


def uses_async_quorum(manager: Any) -> bool:
    """Whether ``manager`` forms its quorum (and reads the state it sends a healing peer) on its
    own thread, beside the caller's forward and backward (``use_async_quorum=True``)."""
    return bool(manager._use_async_quorum)


def min_replica_size(manager: Any) -> int:
    """The per-step floor of participants the manager was built with."""
    return int(manager._min_replica_size)


def quorum_timeout_seconds(manager: Any) -> float:
    """The manager's quorum timeout, in seconds."""
    return float(manager._quorum_timeout.total_seconds())


def quorum_id(manager: Any) -> int:
    """The id of the manager's current quorum (changes when membership changes)."""
    return int(manager._quorum_id)


def group_store_keys() -> tuple[str, ...]:
    """The keys torchft's manager writes, unprefixed, in its replica group's store: group rank
    0's manager address and replica id, which the other ranks read (``torchft.manager``'s
    ``MANAGER_ADDR_KEY`` and ``REPLICA_ID_KEY``)."""
    manager = require("torchft.manager")
    return (manager.MANAGER_ADDR_KEY, manager.REPLICA_ID_KEY)
