"""Source text that makes a fresh interpreter unable to use pickle (for "no pickle" tests).

Run it (``exec``) at the top of a subprocess script, after importing the third-party
modules that import pickle themselves (numpy, torch, ...): it replaces ``pickle`` and its
relatives with poisoned modules (any attribute access fails) and installs a meta-path
hook that refuses to import them again. ``Poisoned`` stays defined for later checks.
"""

BLOCKED_MODULES: tuple[str, ...] = ("pickle", "_pickle", "cPickle", "dill", "cloudpickle")

BLOCK_PICKLE_SOURCE = f"""
import importlib.abc, sys, types

BLOCKED = set({BLOCKED_MODULES!r})


class Poisoned(types.ModuleType):
    def __getattr__(self, name):
        raise AssertionError(f"pickle used: {{self.__name__}}.{{name}}")


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked in this test")
        return None


for name in BLOCKED:
    sys.modules[name] = Poisoned(name)
sys.meta_path.insert(0, Blocker())
"""
