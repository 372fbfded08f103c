import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# multiprocessing's resource tracker is a helper of this pytest process that lives as long as it: start it now,
# before any test's tag is set, so the leak check below never counts it as the process of whichever test used
# multiprocessing first
from multiprocessing import resource_tracker  # noqa: E402

resource_tracker.ensure_running()


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Every process a test starts inherits a tag of that test; one still running after the test (given 10 s to
    end) is killed and fails the test, so that no leaked training can take the machine from the tests after it."""
    import psutil
    from processes import TAG, tagged

    tag = uuid.uuid4().hex
    os.environ[TAG] = tag
    yield
    del os.environ[TAG]
    _, alive = psutil.wait_procs(tagged(tag), timeout=10)
    if alive:
        names = []
        for process in alive:
            try:
                names.append(" ".join(process.cmdline()[:6]))
                process.kill()
            except psutil.NoSuchProcess:
                pass
        pytest.fail(f"the test left {len(alive)} process(es) running, now killed: {names}", pytrace=False)
