"""Name → factory registries (``gradsync.sparsify.get("dgc", density=0.01)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A small registry of named factories with clear errors for unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str, *aliases: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Class decorator: register the factory under ``name`` (and any ``aliases``) and, for a
        class, set its ``name`` attribute to ``name``, so that the name is written once::

            @registry.register("dgc")
            class DGC(Sparsifier): ...      # DGC.name == "dgc"
        """
        names = (name, *aliases)
        for n in names:
            if not isinstance(n, str) or not n:
                raise ValueError(f"{self.kind} names must be non-empty strings, got {n!r}")

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            for n in names:
                if n in self._factories:
                    raise ValueError(f"{self.kind} {n!r} is already registered")
            for n in names:
                self._factories[n] = factory
            if isinstance(factory, type):
                factory.name = name  # type: ignore[attr-defined]
            return factory

        return deco

    def get(self, name: str, **options: object) -> T:
        """Build the ``name`` entry with ``options``; unknown names raise ``ValueError``."""
        return self.factory(name)(**options)

    def factory(self, name: str) -> Callable[..., T]:
        """The ``name`` entry's factory (for a class, its class attributes), unbuilt; unknown
        names raise ``ValueError``."""
        try:
            return self._factories[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories
