"""mpimesh's version, in a module of its own so that any layer may read it (`mpimesh.__version__`).

>>> import mpimesh
>>> mpimesh.__version__ == __version__
True
"""

__version__ = "0.1.0"
