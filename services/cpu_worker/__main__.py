"""python -m services.cpu_worker --config FILE [--index N]: one CPU worker from the cluster config."""
from services.tools.cli import main

if __name__ == "__main__":
    main(["worker", "--device", "cpu", *__import__("sys").argv[1:]])
