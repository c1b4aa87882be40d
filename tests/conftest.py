import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Each test module compiles many programs; drop them afterwards so a full run's memory stays
    flat (a full run on a 2-core / 24 GiB CI machine once aborted inside the XLA CPU compiler)."""
    yield
    import jax
    jax.clear_caches()
    gc.collect()
