"""Build of the optional C extension ``omni_plugins_shm._native`` (metadata is in pyproject.toml).

Optional: if it does not compile (no compiler, not Linux), the package installs without it and
blocking gets wait on inotify and renameat2 goes through ctypes instead (the pure-Python path).
With ``OMNI_REQUIRE_NATIVE=1`` (the project's own set-up, which installs a compiler) a failed
build fails the install: otherwise a source that no longer compiles would go unnoticed next to
an in-place build left from before.
"""

import os
import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "omni_plugins_shm._native",
            sources=["src/_native.c", "src/sharedmap.c"],
            depends=["src/sharedmap.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
            optional=os.environ.get("OMNI_REQUIRE_NATIVE") != "1",
        )
    )

setup(ext_modules=ext_modules)
