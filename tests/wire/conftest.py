"""Every wire test runs twice: on the compiled header path and on the pure-Python one.

The module-scoped, parametrized ``wire_implementation`` fixture switches
``omni_plugins.wire`` for the tests of one module at a time (hypothesis refuses
function-scoped fixtures). The "native" half is skipped only when the extension is
not built; ``tests/wire/test_native.py`` makes that a failure when
``OMNI_REQUIRE_NATIVE=1`` (set by the CI test command).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from omni_plugins.wire import _codec


@pytest.fixture(scope="module", autouse=True, params=["native", "python"])
def wire_implementation(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "native" and _codec.IMPLEMENTATION != "native":
        pytest.skip("omni_plugins.wire._native is not built")
    with _codec.use(request.param):
        yield request.param
