"""The processor mesh: a Cartesian MPI communicator with named dims.

`AbstractMesh` is the mesh without processors: its shape and layout rules, all that planning a
layout needs (which tensor dim goes on which mesh dim, and the block each rank would hold). `Mesh`
is an `AbstractMesh` over an MPI communicator. This module sits below the op layer: the creation
methods (`mesh.zeros`, `mesh.random_normal`, ...) are attached by `mpimesh.creation`.

>>> mesh = Mesh("all:1", layout="batch:all", comm=MPI.COMM_SELF)
>>> mesh.coords, mesh.tensor_layout(Shape("batch:4;io:2"))
({'all': 0}, {'batch': 'all'})
"""
from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import Iterable, Iterator, Mapping, Optional

import numpy as np
from mpi4py import MPI

from . import abort, threads
from .backend import array_module, resolve_backend
from .collectives import make
from .collectives.guard import arrive
from .collectives.liveness import Watch
from .collectives.placement import choose
from .errors import MeshError, ShapeError, by_rank
from .layout import (LayoutRules, RulesLike, TensorLayout, check_rules, layout_dict, layout_from_spec, local_sizes,
                     note_rules, plan_layout)
from .shape import Shape, ShapeLike
from .stack import Stack


_released: list = []  # the communicators of meshes that are gone, freed when the next mesh is built


def _release(comms: list, subcomms: dict) -> None:
    """(A dropped mesh's finalizer.) Its communicators go to `_released`, not freed here: a garbage
    collection may run inside an MPI call of another mesh."""
    for c in comms + list(subcomms.values()):
        if all(c is not d for d in _released):
            _released.append(c)


_kept: list = []  # the communicators of meshes left with transfers in flight: never freed


def _free_released() -> None:
    """Free the communicators of the meshes dropped so far (MPI has a few thousand: a notebook that
    builds a mesh in a cell run again and again ran out of them), but those `_kept`: a new
    communicator could reuse one's context, and its next receive take a stale message."""
    while _released:
        c = _released.pop()
        if any(c is k for k in _kept):
            continue
        if MPI.Is_initialized() and not MPI.Is_finalized() and c != MPI.COMM_NULL:
            try:
                c.Free()
            except MPI.Exception:
                pass


def mesh_shape_of(shape: ShapeLike) -> Shape:
    """`shape` as a mesh shape: a MeshError for a bad string or a dim of size 0."""
    try:
        shape = Shape(shape)
    except ShapeError as e:
        raise MeshError(f"bad mesh shape {shape!r}: {e} (a mesh dim's size is at least 1)") from None
    small = [repr(d.name) for d in shape if d.size < 1]
    if small:
        raise MeshError(f"mesh {shape}: every mesh dim needs size >= 1, but {', '.join(small)} "
                        f"{'has' if len(small) == 1 else 'have'} size 0")
    return shape


_SCALARS = (np.generic, int, float, complex)  # what a kernel may give where `local` must be an array


class AbstractMesh:
    """A mesh shape and its layout rules, without processors or a communicator: enough to plan,
    price and check layouts anywhere (a cost model, a planner on one process). `layout_scope`
    works on it as on a `Mesh`.

    Args:
      shape: mesh dims, e.g. `"rows:2;cols:3"`.
      layout: the global layout rules, e.g. `"batch:rows;hidden:cols"`.

    >>> m = AbstractMesh("rows:2;cols:3", layout="batch:rows;hidden:cols")
    >>> m.size, m.tensor_layout("batch:8;io:4;hidden:7"), m.block_shape("batch:8;io:4;hidden:7")
    (6, {'batch': 'rows', 'hidden': 'cols'}, (4, 4, 3))
    """

    dry = False
    """Whether ops on it run on shapes alone (`mpimesh.dryrun.DryMesh`)."""

    def __init__(self, shape: ShapeLike, layout: RulesLike = ""):
        self._shape = mesh_shape_of(shape)
        self.rules = LayoutRules(layout)
        check_rules(self.rules, self._shape)
        self._scopes = Stack()  # the rules of the open `layout_scope`s, innermost last

    @property
    def shape(self) -> Shape:
        """The mesh dims, as a `Shape`."""
        return self._shape

    @property
    def size(self) -> int:
        """The number of processors (ranks)."""
        return self._shape.size

    @property
    def layout(self) -> LayoutRules:
        """The layout rules in force: the innermost `layout_scope`, else the mesh's own."""
        return self._scopes[-1] if self._scopes else self.rules  # (read per op: no call)

    def plan(self, shape: Shape) -> TensorLayout:
        """The tensor layout (one mesh dim or None per tensor dim) the rules in force give `shape`."""
        return plan_layout(shape, self.shape, self.layout)

    def tensor_layout(self, shape: ShapeLike) -> dict[str, str]:
        """`{tensor_dim: mesh_dim}` for the split dims of a tensor of `shape`."""
        shape = Shape(shape)
        return layout_dict(shape, self.plan(shape))

    def layout_of(self, shape: ShapeLike, layout=None) -> TensorLayout:
        """The tensor layout of `shape` under `layout` (a rules string, list or dict, whose unnamed
        dims are replicated, or a tuple of one mesh dim or None per dim), or under the rules in
        force when `layout` is None.

        >>> m = AbstractMesh("x:2", layout="a:x")
        >>> m.layout_of("a:4;b:6"), m.layout_of("a:4;b:6", "b:x")
        (('x', None), (None, 'x'))
        """
        shape = Shape(shape)
        return self.plan(shape) if layout is None else layout_from_spec(shape, self.shape, layout)

    def block_shape(self, shape: ShapeLike, layout=None, coords: Optional[Mapping[str, int]] = None) -> tuple:
        """The local sizes of a tensor of `shape` laid out by `layout` (see `layout_of`) on the
        processor at `coords`; default coordinate 0 on every mesh dim, whose blocks are the largest
        (`numpy.array_split` puts the longer blocks first), so the same answer on every rank.

        >>> m = AbstractMesh("x:3")
        >>> m.block_shape("a:7", "a:x"), m.block_shape("a:7", "a:x", {"x": 2})
        ((3,), (2,))
        """
        shape = Shape(shape)
        where = dict.fromkeys(self.shape.names, 0) if coords is None else coords
        return local_sizes(shape, self.shape, self.layout_of(shape, layout), where)

    def group_size(self, mesh_dims: Iterable[str]) -> int:
        """Number of processors over `mesh_dims`."""
        n = 1
        for m in mesh_dims:
            n *= self.shape[m].size
        return n

    def abstract(self) -> "AbstractMesh":
        """This mesh's shape and the rules in force, without processors."""
        return AbstractMesh(self.shape, self.layout)

    def __repr__(self) -> str:
        return f"AbstractMesh({str(self.shape)!r}, layout={str(self.rules)!r})"


def _same_everywhere(comm: MPI.Comm, mine: tuple) -> None:
    """A MeshError on every rank unless every rank of `comm` builds the same mesh (shape, rules,
    backend): ranks that disagree would otherwise wait for each other, or cut tensors differently."""
    if comm.Get_size() == 1:
        return
    every = comm.allgather(mine)
    if len(set(every)) > 1:
        what = by_rank([f"mesh {shape}, layout {rules!r}, backend {backend}" for shape, rules, backend in every])
        raise MeshError(f"the ranks build different meshes ({what}): every rank must pass the same shape, "
                        f"layout and backend")


class Mesh(AbstractMesh):
    """An n-D mesh of processors over `comm` (default `MPI.COMM_WORLD`): an `AbstractMesh` with ranks.

    Args:
      shape: mesh dims, e.g. `"rows:2;cols:2"`; their product must equal the number of ranks.
      layout: the global layout rules, e.g. `"batch:rows;hidden:cols"`.
      comm: the communicator to build the mesh over.
      backend: `"numpy"` or `"cupy"` (every `.local` a CuPy array on this rank's GPU); None means
        `$MPIMESH_BACKEND`, else numpy.
      device: the GPU index (cupy); default this rank's index among the ranks on its node, modulo
        the GPUs it sees.
      transport: `"nccl"`, `"mpi"` (the MPI library reads GPU memory), `"staged"` (through pinned
        host buffers) or None (automatic; see `collectives/placement.py`).
    """

    def __init__(self, shape: ShapeLike, layout: RulesLike = "", comm: Optional[MPI.Comm] = None,
                 backend: Optional[str] = None, device: Optional[int] = None, transport: Optional[str] = None):
        shape = mesh_shape_of(shape)
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise MeshError(f"a mesh is built over an MPI intra-communicator (e.g. MPI.COMM_WORLD), got {comm!r}")
        if shape.size != comm.Get_size():
            n = comm.Get_size()
            script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") and "ipykernel" not in sys.argv[0] \
                else "..."
            how = f": launch {shape.size} ranks (mpiexec -n {shape.size} python {script})" if comm == MPI.COMM_WORLD else ""
            raise MeshError(f"mesh {shape} has {shape.size} processors, but the communicator has {n} "
                            f"rank{'' if n == 1 else 's'}{how}")
        super().__init__(shape, layout)
        self._backend = resolve_backend(backend)
        arrive(comm, f"building mesh {shape}")  # (the blocking collectives below would wait for ever)
        _same_everywhere(comm, (str(self.shape), str(self.rules), self._backend))
        self.xp = array_module(self._backend)
        """The array module of this mesh's backend, that every `.local` belongs to: `numpy`, or `cupy`."""
        self._device, self._transport = choose(comm, self._backend, device, transport)
        _free_released()
        try:
            if self.shape.rank:
                self._cart = comm.Create_cart(list(self.shape.sizes), [True] * self.shape.rank, reorder=False)
                self._coords = dict(zip(self.shape.names, self._cart.Get_coords(self._cart.Get_rank())))
            else:
                self._cart = comm.Dup()
                self._coords = {}
            self._guard_comm = self._cart.Dup() if self.size > 1 else self._cart  # the SPMD check's own
        except MPI.Exception as e:
            said = e.Get_error_string().strip().splitlines()[-1].strip()
            raise MeshError(f"cannot make the communicators of mesh {shape}: MPI says {said!r} (too many meshes "
                            f"alive? each holds its own communicators until it is dropped)") from None
        self._rank = self._cart.Get_rank()
        self._coords_key = tuple(self._coords.items())
        self.watch = Watch(self._guard_comm)
        """Who is still in the job (exit notices, process ids): what the collectives' guard asks."""
        self._subcomms: dict[tuple, MPI.Comm] = {}
        weakref.finalize(self, _release, [self._cart, self._guard_comm], self._subcomms).atexit = False
        self._collectives = None
        # a rule that matches no tensor warns from one process: rank 0's (of COMM_WORLD for meshes of one rank)
        self._speaks = self._rank == 0 and (self.size > 1 or MPI.COMM_WORLD.Get_rank() == 0)
        note_rules(self.rules, self.shape, self._speaks)
        abort.install()
        threads.configure_for(comm)

    @property
    def collectives(self):
        """This mesh's collectives (the transport for its backend), made on first use."""
        if self._collectives is None:
            self._collectives = make(self)
        return self._collectives

    @property
    def backend(self) -> str:
        """`"numpy"` or `"cupy"`: the array module of every tensor's `.local`."""
        return self._backend

    @property
    def device(self) -> Optional[int]:
        """The GPU this rank drives (None on the numpy backend)."""
        return self._device

    @property
    def transport(self) -> str:
        """The transport the collectives use: `"mpi"`, `"staged"` or `"nccl"`."""
        return self._transport

    @property
    def rank(self) -> int:
        """This rank (row-major in mesh coordinates)."""
        return self._rank

    @property
    def coords(self) -> dict[str, int]:
        """`{mesh_dim: coordinate}` of this rank."""
        return self._coords

    @property
    def coords_key(self) -> tuple:
        """`coords` as a tuple of `(mesh_dim, coordinate)` pairs: a key for caches of plans."""
        return self._coords_key

    def comm_for(self, mesh_dims: Iterable[str]) -> MPI.Comm:
        """The sub-communicator over `mesh_dims`: ranks whose coordinates differ only there (cached).

        A single name may be given as a string; a name the mesh lacks is a MeshError. It is the
        mesh's own: freed once the mesh is dropped (`.Dup()` it to keep one beyond the mesh)."""
        if isinstance(mesh_dims, str):
            mesh_dims = (mesh_dims,)
        try:
            wanted = set(mesh_dims)
        except TypeError:
            raise MeshError(f"comm_for: expected mesh dim names, got {mesh_dims!r}") from None
        key = tuple(n for n in self.shape.names if n in wanted)
        if len(key) != len(wanted):
            unknown = ", ".join(sorted(repr(n) for n in wanted if n not in key))
            raise MeshError(f"comm_for: {unknown} not a mesh dim of mesh {self.shape} "
                            f"(its dims are {list(self.shape.names)})")
        comm = self._subcomms.get(key)
        if comm is None:
            if self.shape.rank:
                comm = self._cart.Sub([n in key for n in self.shape.names])
            else:
                comm = self._cart
            self._subcomms[key] = comm
        return comm

    def keep_communicators(self) -> None:
        """Never free this mesh's communicators (after transfers were left in flight on them, by an
        error in a pipeline: `pipeline._execute`)."""
        _kept.extend([self._cart, self._guard_comm, *self._subcomms.values()])

    def has_comm(self, mesh_dims: Iterable[str]) -> bool:
        """Whether the sub-communicator over `mesh_dims` exists already (making one is a collective)."""
        return tuple(n for n in self.shape.names if n in set(mesh_dims)) in self._subcomms

    def run(self, op, params: dict, arrays: list, n_out: int, ctx=None, **out) -> tuple:
        """Run `op`'s kernel for this mesh's backend (an `OpDef`, with its `params`) on this rank's
        blocks `arrays`: its `n_out` local outputs, each an array (a kernel reducing to a scalar may
        give a numpy scalar; `local` is always an array). `dispatch` and the compiled replays call it.
        `ctx`: the collectives the kernel is handed (None: the mesh's own). `out`: `out=array` (a
        bucketed gradient's einsum writes there, `mpimesh.buckets`) or `into=` (`OpDef.into`)."""
        coll = self._collectives if ctx is None else ctx
        kernel = op.kernels.get(self._backend, op.kernel) if op.kernels else op.kernel
        if out:
            result = kernel(self.collectives if coll is None else coll, *arrays, **params, **out)
        elif params:
            result = kernel(self.collectives if coll is None else coll, *arrays, **params)
        else:  # (no `**{}`: per-op time)
            result = kernel(self.collectives if coll is None else coll, *arrays)
        if n_out == 1:
            return (self.xp.asarray(result) if isinstance(result, _SCALARS) else result,)
        if not isinstance(result, tuple):  # one array where several were declared: dispatch says so
            return (result,)
        return tuple(self.xp.asarray(r) if isinstance(r, _SCALARS) else r for r in result)

    def barrier(self) -> None:
        """Wait for every rank of the mesh (polled like a collective: under the time-out, and raising
        if a rank left the job)."""
        if self.size > 1:
            self.collectives.guard.barrier()

    def __repr__(self) -> str:
        return f"Mesh({str(self.shape)!r}, layout={str(self.rules)!r}, rank={self.rank})"


@contextmanager
def layout_scope(mesh: AbstractMesh, rules: RulesLike) -> Iterator[LayoutRules]:
    """Inside the block, ops on `mesh` lay out their outputs by `rules` instead of the mesh's
    (on an `AbstractMesh` too: its `plan` and `tensor_layout` follow them).

    >>> mesh = Mesh("all:1", layout="batch:all", comm=MPI.COMM_SELF)
    >>> with layout_scope(mesh, "hidden:all"):
    ...     mesh.tensor_layout(Shape("batch:2;hidden:2"))
    {'hidden': 'all'}
    """
    if not isinstance(mesh, AbstractMesh):
        raise TypeError(f"layout_scope: the first argument is the mesh, got a {type(mesh).__name__} "
                        f"({mesh!r:.60}): layout_scope(mesh, rules)")
    rules = LayoutRules(rules)
    check_rules(rules, mesh.shape)
    if isinstance(mesh, Mesh):
        note_rules(rules, mesh.shape, mesh._speaks)
    with mesh._scopes.push(rules):
        yield rules
