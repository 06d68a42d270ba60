"""The lifetime every llama.cpp object shares: closed by its owner, or at worst when collected."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeVar

T = TypeVar("T", bound="NativeObject")


class NativeObject(ABC):
    """A context manager over ``close()``; ``close()`` must be safe to call twice."""

    @abstractmethod
    def close(self) -> None:
        """Free the native object (idempotent)."""

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort: owners close explicitly, in reverse order
        try:
            self.close()
        except Exception:
            pass
