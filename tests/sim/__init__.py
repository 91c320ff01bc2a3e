"""A deterministic simulator of one pool: the real scheduler (ContinuousBatcher with its planner,
policy, admission, prefix cache, streaming windows, failover, membership and cut-ins, and the real
WorkerLink) against simulated workers and clients, on a virtual clock with a seeded source of
faults. No sockets, no threads: one seed replays one run exactly.

    python -m tests.sim.replay --seed N          one run, its faults and what broke
    python -m tests.sim.replay --seeds 0:100000  many runs (bench/results/fault_sim.json)

Start reading at run.py (`simulate`). Nothing in services/ imports this package.
"""
