"""The core conformance suite against the shm connector."""

from __future__ import annotations

from typing import Any

import pytest

from omni_plugins.testing import ConnectorContract


class TestShmContract(ConnectorContract):
    cross_process = True
    bad_config = {"namespace": "no/slashes allowed"}

    @pytest.fixture
    def connector_spec(self, namespace: str) -> tuple[str, dict[str, Any]]:
        return "shm", {"namespace": namespace}


class TestShmContractZeroCopy(ConnectorContract):
    """The same contract holds when ``get`` hands out zero-copy views.

    The cross-process part is the same code path as above and spawning costs seconds;
    zero-copy across processes is covered in ``test_multiprocess.py``.
    """

    cross_process = False
    bad_config = {"pool_bytes": -1}

    @pytest.fixture
    def connector_spec(self, namespace: str) -> tuple[str, dict[str, Any]]:
        return "shm", {"namespace": namespace, "zero_copy": True}


class TestShmContractInotify(ConnectorContract):
    """The contract on the path without the C extension: blocked gets wait on inotify (``futex_wait: false``)."""

    cross_process = True
    bad_config = {"futex_wait": "sometimes"}

    @pytest.fixture
    def connector_spec(self, namespace: str) -> tuple[str, dict[str, Any]]:
        return "shm", {"namespace": namespace, "futex_wait": False}
