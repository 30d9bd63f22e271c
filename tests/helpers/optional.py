"""Optional system libraries of the tests: the one check per library that every test needing it
uses to skip (naming the reason), and a switch that hides a library from this process.

A Python package can be installed while the system library its native module links is not
(``pip install dlslime`` on a machine without the ``libibverbs1`` package): importing it then
fails with ``ImportError: libibverbs.so.1: cannot open shared object file``. Each check below
asks the code under test itself (``dlbatch.transfer.dlslime_transport.unavailable_reason``),
so a test skips exactly when the runtime would refuse the feature.

Hiding (``DLBATCH_TEST_HIDE=libibverbs``, honoured by tests/conftest.py; or `hide` in a test):
a meta-path finder makes the native modules that link the library fail to import with the
loader's own message, as on a machine without it, and drops them from ``sys.modules``. CI runs
the tests of these libraries once so (.ci/run), on a machine where the library is installed, so
a test that forgets to skip fails there instead of on a newcomer's machine.
"""
from __future__ import annotations

import importlib.abc
import os
import sys

HIDE_ENV = "DLBATCH_TEST_HIDE"

# a system library -> (its soname, the native modules that link it)
LIBRARIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "libibverbs": ("libibverbs.so.1", ("dlslime._slime_c",)),
}


class HiddenLibrary(importlib.abc.MetaPathFinder):
    """Fails the import of the native modules that link ``library`` as the dynamic loader would."""

    def __init__(self, library: str):
        if library not in LIBRARIES:
            raise ValueError(f"{HIDE_ENV}: unknown library {library!r}; known: {', '.join(sorted(LIBRARIES))}")
        self.library = library
        self.soname, self.modules = LIBRARIES[library]

    def find_spec(self, name, path=None, target=None):
        if name in self.modules:
            raise ImportError(f"{self.soname}: cannot open shared object file: No such file or directory "
                              f"(hidden by {HIDE_ENV}={self.library})", name=name)
        return None


def _forget(modules: tuple[str, ...]) -> None:
    """Drop the native modules and the packages above them, so the next import runs again."""
    roots = {m.split(".")[0] for m in modules}
    for name in list(sys.modules):
        if name.split(".")[0] in roots:
            del sys.modules[name]


def hide(library: str):
    """Hide ``library`` from this process; returns a function that shows it again."""
    finder = HiddenLibrary(library)
    sys.meta_path.insert(0, finder)
    _forget(finder.modules)

    def show() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        _forget(finder.modules)

    return show


def hide_from_environment() -> list[str]:
    """Hide every library named in ``DLBATCH_TEST_HIDE`` (comma-separated); returns their names."""
    names = [n.strip() for n in os.environ.get(HIDE_ENV, "").split(",") if n.strip()]
    for name in names:
        hide(name)
    return names


def dlslime_missing() -> str | None:
    """Why the dlslime transport cannot run here (the runtime's own check), or None."""
    from dlbatch.transfer.dlslime_transport import unavailable_reason

    return unavailable_reason()
