"""Build of the core's one optional C extension, ``omni_plugins.wire._native``.

Metadata lives in pyproject.toml; this file only declares the extension. It is optional:
when it cannot be compiled the install still succeeds and ``omni_plugins.wire`` uses its
pure-Python header path (``omni_plugins.wire.IMPLEMENTATION == "python"``). With
``OMNI_REQUIRE_NATIVE=1`` (the project's own set-up, which installs a compiler) a failed build
fails the install instead, so a source that no longer compiles is not hidden by an in-place
build left from before.
"""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "omni_plugins.wire._native",
            ["omni_plugins/wire/_native.c"],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
            optional=os.environ.get("OMNI_REQUIRE_NATIVE") != "1",
        )
    ]
)
