"""python -m services.gpu_worker --config FILE [--pool NAME] [--index N] [--device cuda:N]"""
import sys

from services.tools.cli import main

if __name__ == "__main__":
    main(["worker", "--device", "cuda", *sys.argv[1:]])
