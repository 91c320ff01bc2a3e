"""python -m services.npu_worker --config FILE [--pool NAME] [--index N] [--device npu:N]"""
import sys

# services.tools.cli sets TORCH_DEVICE_BACKEND_AUTOLOAD=0 before anything imports torch.
from services.tools.cli import main

if __name__ == "__main__":
    main(["worker", "--device", "npu", *sys.argv[1:]])
