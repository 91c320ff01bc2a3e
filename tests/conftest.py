import sys
from pathlib import Path

# Tests import the project and the helpers beside them without an install step.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
