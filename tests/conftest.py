import sys
from pathlib import Path

# Tests import the project and the helpers beside them without an install step.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Every cluster a test starts bills into one throwaway database, never the user's own
# (~/.cache/qos-serve/qos-serve.db); tests that look at the ledger give their own store.url.
import os  # noqa: E402
import tempfile  # noqa: E402

os.environ.setdefault("QOS_STORE_URL", f"sqlite:///{tempfile.mkdtemp(prefix='qos-test-store-')}/store.db")
