"""A test plugin that fails at import time."""

raise RuntimeError("omni_test_broken exploded on import")
