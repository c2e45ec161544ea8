"""Build of the core's one optional C extension, ``omni_plugins.wire._native``.

Metadata lives in pyproject.toml; this file only declares the extension. It is optional:
when it cannot be compiled the install still succeeds and ``omni_plugins.wire`` uses its
pure-Python header path (``omni_plugins.wire.IMPLEMENTATION == "python"``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "omni_plugins.wire._native",
            ["omni_plugins/wire/_native.c"],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
            optional=True,
        )
    ]
)
