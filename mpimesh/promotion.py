"""Dtype promotion: the dtype an op combining tensors of several dtypes produces, from a table written
out here (JAX's, with 64-bit types), whatever the installed numpy or ml_dtypes would say.

An integer with a float gives the float, bfloat16 with float16 gives float32, a signed integer with
uint64 gives float64; several dtypes promote as JAX's `result_type` does (integers beside floats
give the floats' promotion). `operand_casts` says what a numpy kernel must cast its operands to for
that dtype. The rules and where numpy differs: docs/dtypes.md.

>>> result_type("int32", "float32"), result_type("bfloat16", "int64"), result_type("bfloat16", "float16")
(dtype('float32'), dtype(bfloat16), dtype('float32'))
>>> result_type("int64", "uint64"), result_type("int64", "uint64", "float16"), result_type("uint8", "int8")
(dtype('float64'), dtype('float16'), dtype('int16'))
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import ml_dtypes
import numpy as np

from .errors import DTypeError

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

_NAMES = {"b": "bool", "i1": "int8", "i2": "int16", "i4": "int32", "i8": "int64", "u1": "uint8", "u2": "uint16",
          "u4": "uint32", "u8": "uint64", "f2": "float16", "bf": "bfloat16", "f4": "float32", "f8": "float64",
          "c8": "complex64", "c16": "complex128"}

# Row dtype with column dtype; symmetric (tests/test_promotion.py checks every entry against JAX).
TABLE = """
       b  i1  i2  i4  i8  u1  u2  u4  u8  f2  bf  f4  f8  c8 c16
   b   b  i1  i2  i4  i8  u1  u2  u4  u8  f2  bf  f4  f8  c8 c16
  i1  i1  i1  i2  i4  i8  i2  i4  i8  f8  f2  bf  f4  f8  c8 c16
  i2  i2  i2  i2  i4  i8  i2  i4  i8  f8  f2  bf  f4  f8  c8 c16
  i4  i4  i4  i4  i4  i8  i4  i4  i8  f8  f2  bf  f4  f8  c8 c16
  i8  i8  i8  i8  i8  i8  i8  i8  i8  f8  f2  bf  f4  f8  c8 c16
  u1  u1  i2  i2  i4  i8  u1  u2  u4  u8  f2  bf  f4  f8  c8 c16
  u2  u2  i4  i4  i4  i8  u2  u2  u4  u8  f2  bf  f4  f8  c8 c16
  u4  u4  i8  i8  i8  i8  u4  u4  u4  u8  f2  bf  f4  f8  c8 c16
  u8  u8  f8  f8  f8  f8  u8  u8  u8  u8  f2  bf  f4  f8  c8 c16
  f2  f2  f2  f2  f2  f2  f2  f2  f2  f2  f2  f4  f4  f8  c8 c16
  bf  bf  bf  bf  bf  bf  bf  bf  bf  bf  f4  bf  f4  f8  c8 c16
  f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f4  f8  c8 c16
  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8  f8 c16 c16
  c8  c8  c8  c8  c8  c8  c8  c8  c8  c8  c8  c8  c8 c16  c8 c16
 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16 c16
"""


def _parse(text: str) -> dict:
    """`{(row dtype, column dtype): their promotion}` from `TABLE`."""
    header, *rows = (line.split() for line in text.strip().splitlines())
    dt = {code: np.dtype(name) for code, name in _NAMES.items()}
    return {(dt[row[0]], dt[col]): dt[cell] for row in rows for col, cell in zip(header, row[1:])}


_PAIRS = _parse(TABLE)
DTYPES = tuple(dict.fromkeys(a for a, _ in _PAIRS))
"""The dtypes the table covers, in its order."""


def is_inexact(dtype: np.dtype) -> bool:
    """Whether `dtype` is a float (bfloat16 included) or complex dtype."""
    return dtype.kind in "fc" or dtype == BFLOAT16


def result_type(*dtypes) -> np.dtype:
    """The dtype an op combining operands of `dtypes` produces: the table's (JAX's) promotion, numpy's
    for dtypes outside it. A `DTypeError` for no dtype or something that is not one.

    >>> result_type("bool", "uint8"), result_type("float16", np.int64), result_type("float32", "complex64", "int8")
    (dtype('uint8'), dtype('float16'), dtype('complex64'))
    """
    try:
        return _result(dtypes)
    except TypeError:  # an unhashable argument: not a dtype
        return _promote(dtypes)


@lru_cache(maxsize=4096)
def _result(dtypes: tuple) -> np.dtype:
    return _promote(dtypes)


def _promote(dtypes: tuple) -> np.dtype:
    if not dtypes:
        raise DTypeError("result_type needs at least one dtype")
    try:
        dts = [np.dtype(d).newbyteorder("=") for d in dtypes]
    except (TypeError, ValueError, SyntaxError) as e:
        raise DTypeError(f"result_type: cannot read {dtypes!r} as dtypes ({e})") from None
    if not all(d in _COVERED for d in dts):
        try:  # (bfloat16 as float32 for numpy: ml_dtypes before 0.5 promotes it with nothing)
            return np.result_type(*(np.float32 if d == BFLOAT16 else d for d in dts))
        except TypeError as e:
            raise DTypeError(f"result_type: no common dtype of {', '.join(map(str, dts))} ({e})") from None
    # the floats first: every integer and bool lies below every float in JAX's lattice, so the integers
    # then change nothing (int64 with uint64 first would give float64, above float16)
    out, *rest = sorted(dts, key=lambda d: not is_inexact(d)) if len(dts) > 2 else dts
    for d in rest:
        out = _PAIRS[out, d]
    return out


_COVERED = frozenset(DTYPES)


@lru_cache(maxsize=4096)
def operand_casts(dtypes: tuple) -> Optional[tuple]:
    """What a numpy kernel combining arrays of `dtypes` must cast them to first so that its result has
    `result_type(*dtypes)` and the values JAX gives: per operand that dtype or None (as it is); None
    for all of them (the common case: numpy's own promotion gives it). An operand is cast where
    numpy's promotion of `dtypes` differs from the table's (or fails), and an integer or bool going to
    a float (it rounds to that float, as in JAX, not to numpy's wider one).

    >>> operand_casts(("float32", "float32")), operand_casts(("float32", "bfloat16"))
    (None, None)
    >>> operand_casts(("int32", "float32")), operand_casts(("bfloat16", "int32"))
    ((dtype('float32'), None), (None, dtype(bfloat16)))
    """
    want = result_type(*dtypes)
    dts = [np.dtype(d) for d in dtypes]
    try:
        theirs = np.result_type(*dts)
    except TypeError:  # numpy's DTypePromotionError: bfloat16 with float16 before ml_dtypes 0.7
        theirs = None
    widening = is_inexact(want)
    casts = tuple(want if d != want and (theirs != want or widening and not is_inexact(d)) else None for d in dts)
    return casts if any(c is not None for c in casts) else None


def cast_operands(arrays, casts: Optional[tuple]) -> list:
    """`arrays` cast as `operand_casts` said (`casts` None: as they are)."""
    if casts is None:
        return list(arrays)
    return [a if c is None else a.astype(c) for a, c in zip(arrays, casts)]
