import sys
from pathlib import Path

# Tests import the project and the helpers beside them without an install step.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Every cluster a test starts bills into one throwaway database, never the user's own
# (~/.cache/qos-serve/qos-serve.db); tests that look at the ledger give their own store.url.
import atexit  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "QOS_STORE_URL" not in os.environ:
    _store_dir = tempfile.mkdtemp(prefix="qos-test-store-")
    atexit.register(shutil.rmtree, _store_dir, ignore_errors=True)   # the clusters are down by then
    os.environ["QOS_STORE_URL"] = f"sqlite:///{_store_dir}/store.db"
