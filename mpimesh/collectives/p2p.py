"""Point-to-point transfers along one mesh dim, for pipelines: `isendrecv` (not waiting) and
`broadcast_from`. Unlike
`permute`, what a rank sends and what it receives may differ in shape (a microbatch of another size, or
nothing: an empty array), so a stage hands its neighbour one activation per tick. Both are collectives
of the group over the mesh dim in the transports' way: the SPMD check (`guard.enter`: every rank of the
mesh at the same transfer, shapes left out since they may differ), the profile's counters, the time-out
while polled (`MpiCollectives._complete`), and a departed neighbour named with its stage
(`stages_text`). Transports post them as a permute.

>>> import numpy as np
>>> from mpimesh import Mesh, MPI
>>> coll = Mesh("stages:1", comm=MPI.COMM_SELF).collectives
>>> isendrecv(coll, np.arange(3.0), "stages", 1, (3,)).wait(), broadcast_from(coll, np.ones(2), "stages", 0)
(array([0., 1., 2.]), array([1., 1.]))
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .. import counters, flight
from ..backend import is_low_precision, to_host, wire_dtype
from ..errors import CollectiveTimeoutError, MpimeshError
from .base import DONE, Overlapped, Request, completed


def isendrecv(coll, x, mesh_dim: str, offset: int, recv_shape: tuple, out=None) -> Request:
    """Start sending `x` to coordinate c+offset along `mesh_dim` (cyclically) and receiving what
    coordinate c-offset sends, an array of `recv_shape` and x's dtype (`out`, where given), without
    waiting: a `Request` whose `wait()` completes it (polled, under the time-out) and gives what
    arrived, counted in the profile's overlap (`Overlapped`: its timeline event on the "comm" track);
    `x` must not change until then. Every rank of the mesh starts its transfers in the same order, and
    may complete them in any order; an empty `x` sends nothing, an empty `recv_shape` receives nothing."""
    recv_shape = tuple(int(n) for n in recv_shape)
    k = coll.size((mesh_dim,))
    if k == 1 or offset % k == 0:  # to itself
        if tuple(x.shape) != recv_shape:
            raise MpimeshError(f"sendrecv over {mesh_dim!r} to itself: sends shape {tuple(x.shape)}, expects "
                               f"{recv_shape}")
        return completed(x.copy() if out is None else _into(out, x))
    c = coll.coord(mesh_dim)
    dest, src = (c + offset) % k, (c - offset) % k
    xp = coll.xp if not isinstance(x, np.ndarray) else np
    send = xp.ascontiguousarray(x)
    recv = xp.empty(recv_shape, x.dtype) if out is None else out
    req = _start(coll, "sendrecv", mesh_dim, send, recv, f" offset {offset}", dest=dest, src=src)

    def then(send=send):  # (the request holds `send` until it completes)
        req.wait()
        return recv
    return Overlapped(req.test, lambda: _complete(coll, req, mesh_dim, dest=dest, src=src), then,
                      getattr(req, "span", None) if flight.timeline else None)


def broadcast_from(coll, x, mesh_dim: str, root: int):
    """Coordinate `root`'s `x` along `mesh_dim` on every rank of its group (each passes an array of
    the shape and dtype `root` sends: what it holds is overwritten, in a copy)."""
    k = coll.size((mesh_dim,))
    if not 0 <= root < k:
        raise MpimeshError(f"broadcast over {mesh_dim!r}: root {root} is not a coordinate 0..{k - 1}")
    if k == 1:
        return x
    buf = np.array(to_host(x), copy=True, order="C")  # (through the host on a GPU: not a hot path)
    _transfer(coll, "broadcast", mesh_dim, buf, buf, f" from {root}", root=root)
    return buf if isinstance(x, np.ndarray) else coll.xp.asarray(buf)


def _into(out, x):
    out[...] = x
    return out


def _transfer(coll, kind: str, mesh_dim: str, send, recv, detail: str, **where) -> None:
    """Check, count, post and complete one transfer, as `MpiCollectives._run` does."""
    _complete(coll, _start(coll, kind, mesh_dim, send, recv, detail, **where), mesh_dim, **where)


def _complete(coll, request, mesh_dim: str, **where) -> None:
    """Wait for a transfer's `request` (polled, under the time-out); a time-out names the stages."""
    try:
        coll._complete(request, (mesh_dim,))
    except CollectiveTimeoutError as e:
        raise CollectiveTimeoutError(f"{e} {stages_text(coll, mesh_dim, **where)}") from None


def _start(coll, kind: str, mesh_dim: str, send, recv, detail: str, **where) -> Request:
    """Check, count and post one transfer: its request. The SPMD check compares no shapes (ranks may
    send and receive blocks of other shapes, or none)."""
    dims = (mesh_dim,)
    coll._two_steps.drain()
    coll.guard.enter(kind, dims, send, detail, shape="")
    counters.record(kind, dims, send.size, send.nbytes)
    mesh = coll.mesh
    if not mesh.has_comm(dims):  # making it is a collective over the whole mesh: first, every rank is here
        coll.guard.wait_mpi(coll.guard.comm.Ibarrier(), f"making the communicator over {mesh_dim}")
    if kind == "broadcast":
        comm = coll._comm(dims)
        words = send.view(wire_dtype(send.dtype)) if is_low_precision(send.dtype) else send
        req = comm.Ibcast(words, root=where["root"]) if send.size else None
        request = DONE if req is None else Request(req.Test, req.Wait)
    elif send.size == 0 and recv.size == 0:
        mesh.comm_for(dims)
        request = DONE
    else:
        request = _post(coll, dims, send, recv, where["dest"], where["src"])
    if flight.timeline:  # (its span, and the wait for the last rank to arrive, in an open timeline)
        coll._spanned(request, kind, dims, send.nbytes)
    return request


def group_ranks(mesh, dims) -> list:
    """The mesh ranks of this rank's group over mesh dims `dims` (coordinates differ only there), in
    row-major order of their coordinates: the ranks of the stage mesh, or of the stages along a dim.

    >>> from mpimesh import Mesh, MPI
    >>> group_ranks(Mesh("stages:1;cols:1", comm=MPI.COMM_SELF), ("stages",))
    [0]
    """
    ranks = [0]
    for d in mesh.shape:
        steps = range(d.size) if d.name in dims else [mesh.coords[d.name]]
        ranks = [r * d.size + c for r in ranks for c in steps]
    return ranks


def stages_text(coll, mesh_dim: str, dest=None, src=None, root=None) -> str:
    """For an error in a transfer along `mesh_dim`: which rank is which stage (coordinate along it), those
    known to have left the job first, and this rank's partners in the transfer."""
    ranks = group_ranks(coll.mesh, (mesh_dim,))
    c = coll.coord(mesh_dim)
    gone = coll.guard.watch.gone([r for j, r in enumerate(ranks) if j != c])
    text = [f"stage {j} (rank {r}) left the job" for j, r in enumerate(ranks) if r in gone]
    text.append(f"this rank (rank {ranks[c]}) is stage {c} of {len(ranks)}")
    if root is not None:
        text.append(f"it takes stage {root}'s broadcast (rank {ranks[root]})")
    if dest is not None:
        text.append(f"it sends to stage {dest} (rank {ranks[dest]}) and receives from stage {src} (rank {ranks[src]})")
    return f"Along the pipeline's mesh dim {mesh_dim!r}: " + "; ".join(text) + "."


def _post(coll, dims: tuple, send, recv, dest: int, src: int) -> Request:
    """The transport's permute, with a side left out where it moves nothing (an empty send or
    receive: MPI's null process)."""
    dest = dest if send.size else MPI.PROC_NULL
    src = src if recv.size else MPI.PROC_NULL
    return coll._post("permute", dims, send, recv, dest=dest, src=src)
