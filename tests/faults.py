"""Fault injection at the os-call level, for the file tiers and whatever sits on them.

:class:`FaultInjector` replaces the ``os`` name inside the modules that do file I/O
(the modules of the ``tieredkv.backends.ssd`` package and ``tieredkv.backends.mmap`` by
default) with a proxy: every attribute is the real :mod:`os` one, except the functions
named in :data:`SITES`, which are wrapped so that a call may raise ``OSError(EIO)`` (or
``ENOSPC``, or any errno) instead of reaching the kernel. Only those modules see the proxy:
pytest, anyio and the rest of the process keep the real :mod:`os`, so a fault always lands
on a tier's own call.

Three kinds of rule, combinable:

- ``rate``: each call of an eligible site fails with probability ``rate``, drawn from a
  :class:`random.Random` seeded by ``seed`` (the same seed and the same sequence of calls
  give the same faults);
- :meth:`FaultInjector.fail_nth`: the ``n``-th call (from 1) of one site fails;
- :meth:`FaultInjector.fail_always`: every call of one site fails (until
  :meth:`FaultInjector.clear`);
- :meth:`FaultInjector.fail_matching`: the next ``times`` calls of one site whose first
  argument is a name containing some text fail (one file's ``os.open``, say).

Calls per site and faults injected per site are counted; the counting and the random draws
hold a lock, so calls from anyio worker threads are counted exactly and draw in a
well-defined (if thread-scheduling dependent) order. :meth:`FaultInjector.paused` turns
injection off (calls are still counted) for a test's setup or final check.
"""

from __future__ import annotations

import errno as errno_mod
import importlib
import os
import pkgutil
import random
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from tests.conftest import _BLOCKING  # the os calls that do file I/O, named once

__all__ = ["DEFAULT_MODULES", "SITES", "SSD_MODULES", "FaultInjector", "InjectedFault"]

SITES: frozenset[str] = frozenset(_BLOCKING) | {
    "close",
    "fstat",
    "stat",
    "lstat",
    "rmdir",
    "posix_fadvise",
}
"""The os functions that can be faulted (a site is one of these names)."""

_RANDOM_DEFAULT = SITES - {"close"}
"""Sites eligible for random faults unless ``sites=`` says otherwise: ``close`` is left out
(Linux closes the descriptor even when ``close`` reports EIO, so a fault there tests
nothing but log noise); name it explicitly to include it."""


def _ssd_modules() -> tuple[str, ...]:
    """The modules of the SSD tier's package that call ``os`` (every one that imports it)."""
    import tieredkv.backends.ssd as package

    names = []
    for info in pkgutil.iter_modules(package.__path__):
        name = f"{package.__name__}.{info.name}"
        if getattr(importlib.import_module(name), "os", None) is os:
            names.append(name)
    return tuple(names)


SSD_MODULES: tuple[str, ...] = _ssd_modules()
"""The modules of :mod:`tieredkv.backends.ssd` that do file I/O."""

DEFAULT_MODULES: tuple[str, ...] = (*SSD_MODULES, "tieredkv.backends.mmap")
"""Modules whose ``os`` is replaced unless ``modules=`` says otherwise (plus
``tieredkv.fsck`` when it is importable)."""


class InjectedFault(OSError):
    """The OSError an injected fault raises (a subclass, so tests can tell it apart)."""


class _OsProxy(ModuleType):
    """Stands in for :mod:`os` in one module: real attributes, faulting sites."""

    def __init__(self, injector: FaultInjector) -> None:
        super().__init__("os")
        self._injector = injector

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if name in SITES:
            return self._injector._wrap(name)
        return real


class FaultInjector:
    """Make os calls of the file tiers fail on purpose; a context manager.

    :param seed: seeds the random draws of ``rate`` (and the choice among ``errnos``)
    :param rate: probability that one call of an eligible site fails (0 for none)
    :param errnos: the errno of a random fault, chosen uniformly among these
    :param sites: the sites eligible for random faults (default: every site but ``close``)
    :param modules: the modules whose ``os`` is replaced, by import name
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        rate: float = 0.0,
        errnos: Iterable[int] = (errno_mod.EIO,),
        sites: Iterable[str] | None = None,
        modules: Iterable[str] = DEFAULT_MODULES,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], not {rate}")
        chosen = frozenset(_RANDOM_DEFAULT if sites is None else sites)
        _check_sites(chosen)
        self.rate = rate
        self._errnos = tuple(errnos)
        if not self._errnos:
            raise ValueError("errnos must name at least one errno")
        self._random_sites = chosen
        self._rng = random.Random(seed)
        self._module_names = tuple(modules)
        self._lock = threading.Lock()
        self._nth: dict[str, dict[int, int]] = {}
        self._always: dict[str, int] = {}
        self._matching: dict[str, list[list[Any]]] = {}
        """Per site: [text, calls left to fail, errno] rules of :meth:`fail_matching`."""
        self._paused = 0
        self._saved: list[tuple[ModuleType, Any]] = []
        self._wrappers: dict[str, Callable[..., Any]] = {}
        self.calls: Counter[str] = Counter()
        """Calls per site (faulted ones included), since construction."""
        self.injected: Counter[str] = Counter()
        """Faults injected per site, since construction."""

    # -- rules ---------------------------------------------------------------------------
    def fail_nth(self, site: str, n: int, err: int = errno_mod.EIO) -> None:
        """Fail the ``n``-th call of ``site`` (counted from 1 since construction)."""
        _check_sites({site})
        if n < 1:
            raise ValueError(f"n counts calls from 1, not {n}")
        with self._lock:
            self._nth.setdefault(site, {})[n] = err

    def fail_always(self, site: str, err: int = errno_mod.EIO) -> None:
        """Fail every call of ``site`` from now on."""
        _check_sites({site})
        with self._lock:
            self._always[site] = err

    def fail_matching(self, site: str, text: str, times: int = 1, err: int = errno_mod.EIO) -> None:
        """Fail the next ``times`` calls of ``site`` whose first argument is a ``str`` or
        ``bytes`` name containing ``text`` (calls naming other files pass)."""
        _check_sites({site})
        if times < 1:
            raise ValueError(f"times must be at least 1, not {times}")
        with self._lock:
            self._matching.setdefault(site, []).append([text, times, err])

    def clear(self) -> None:
        """Remove every rule and set ``rate`` to 0 (the counts stay)."""
        with self._lock:
            self._nth.clear()
            self._always.clear()
            self._matching.clear()
            self.rate = 0.0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No faults inside this block (calls are still counted)."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    @property
    def total_injected(self) -> int:
        """Faults injected at all sites."""
        with self._lock:
            return sum(self.injected.values())

    # -- patching ------------------------------------------------------------------------
    def __enter__(self) -> FaultInjector:
        if self._saved:
            raise RuntimeError("this FaultInjector is already active")
        names = list(self._module_names)
        if self._module_names == DEFAULT_MODULES and "tieredkv.fsck" not in names:
            try:
                __import__("tieredkv.fsck")
                names.append("tieredkv.fsck")
            except ImportError:
                pass
        for name in names:
            __import__(name)
            module = sys.modules[name]
            if getattr(module, "os", None) is not os:
                raise RuntimeError(f"module {name} does not use 'import os'; cannot patch it")
            self._saved.append((module, os))
            setattr(module, "os", _OsProxy(self))  # noqa: B010 (mypy: modules are not typed)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for module, real in reversed(self._saved):
            setattr(module, "os", real)  # noqa: B010
        self._saved.clear()

    # -- the wrapped calls ---------------------------------------------------------------
    def _wrap(self, site: str) -> Callable[..., Any]:
        wrapper = self._wrappers.get(site)
        if wrapper is None:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                name = args[0] if args else None
                err = self._decide(site, os.fsdecode(name) if isinstance(name, str | bytes) else "")
                if err is None:
                    # looked up per call: a test may have patched os itself meanwhile
                    return getattr(os, site)(*args, **kwargs)
                # the traceback keeps this frame: it must not pin the caller's buffers
                del args, kwargs
                raise InjectedFault(err, f"injected {os.strerror(err)} in os.{site}")

            self._wrappers[site] = wrapper
        return wrapper

    def _decide(self, site: str, name: str = "") -> int | None:
        with self._lock:
            self.calls[site] += 1
            n = self.calls[site]
            err = self._nth.get(site, {}).pop(n, None)
            if err is None and name and not self._paused:
                for rule in self._matching.get(site, []):
                    if rule[1] and rule[0] in name:
                        rule[1] -= 1
                        err = rule[2]
                        break
            if err is None:
                err = self._always.get(site)
            # drawn even when paused, so pausing does not shift later random faults
            if (
                err is None
                and self.rate
                and site in self._random_sites
                and self._rng.random() < self.rate
            ):
                err = self._rng.choice(self._errnos)
            if err is None or self._paused:
                return None
            self.injected[site] += 1
            return err


def _check_sites(sites: Iterable[str]) -> None:
    unknown = sorted(set(sites) - SITES)
    if unknown:
        raise ValueError(f"unknown fault sites {unknown}; known: {sorted(SITES)}")
