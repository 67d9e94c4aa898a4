"""Ops, one module per family; each runs through `mpimesh.trace.dispatch`, which records it
(creation too: `mesh.zeros` is the op "full").

>>> import mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> with mm.trace() as tr:
...     y = mm.reduce_max(mm.exp(mesh.zeros("a:3")))
>>> [op.name for op in tr.ops], float(y.to_numpy())
(['full', 'exp', 'reduce_max'], 1.0)
"""
