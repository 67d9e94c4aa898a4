"""`Stack`: what `with` blocks have opened, innermost last (the open traces, the counters of the open
profiles, a mesh's layout scopes, the remat policies...), pushed for a block and taken off at its end.

>>> scopes = Stack()
>>> with scopes.push("outer"), scopes.push("inner"):
...     scopes.top(), list(scopes)
('inner', ['outer', 'inner'])
>>> scopes.top(), bool(scopes)
(None, False)
"""
from __future__ import annotations

from typing import Any


class Stack(list):
    """A list of the values open `with` blocks pushed, innermost last. A list, so that a hot path tests
    it (`if stack:`) and walks it at a list's speed."""

    __slots__ = ()

    def push(self, value: Any) -> "_Pushed":
        """A context manager that puts `value` on top for the block (and yields it); the block's end
        takes that entry off again (by identity: nested blocks may push equal values), also on an
        exception."""
        return _Pushed(self, value)

    def top(self, default: Any = None) -> Any:
        """The innermost value, or `default` where the stack is empty."""
        return self[-1] if self else default

    def drop(self, value: Any) -> None:
        """Take the innermost entry that is `value` off (nothing where there is none)."""
        for i in range(len(self) - 1, -1, -1):
            if self[i] is value:
                del self[i]
                return


class _Pushed:
    """`Stack.push`'s context manager (a class, not a generator: ops open some per call)."""

    __slots__ = ("stack", "value")

    def __init__(self, stack: Stack, value: Any):
        self.stack, self.value = stack, value

    def __enter__(self) -> Any:
        self.stack.append(self.value)
        return self.value

    def __exit__(self, *exc) -> None:
        self.stack.drop(self.value)
