"""The local cluster's supervisor (services/local/supervisor.py), on fake processes and a fake
clock: restart with doubling backoff, give up after repeated crashes in a window, backoff reset
after a healthy run, and the status file the router reads."""
from __future__ import annotations

from services.common.process_status import read_status
from services.local.supervisor import RestartPolicy, Supervisor


class FakeProcess:
    pids = iter(range(1000, 2000))

    def __init__(self):
        self.pid = next(self.pids)
        self.returncode = None

    def poll(self):
        return self.returncode

    def die(self, code: int = -9) -> None:
        self.returncode = code


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def supervised(tmp_path, policy=RestartPolicy(first_delay_s=1, max_delay_s=8, crash_limit=4, window_s=60)):
    clock, lines, launched = Clock(), [], []

    def relaunch(name):
        launched.append(name)
        return FakeProcess()

    supervisor = Supervisor({"cpu/worker-0": FakeProcess(), "router": FakeProcess()}, relaunch, policy,
                            status_file=tmp_path / "processes.json", say=lines.append, clock=clock)
    return supervisor, clock, lines, launched


def crash(supervisor, clock, name="cpu/worker-0"):
    supervisor.watched[name].process.die()
    supervisor.check()
    return supervisor.watched[name]


def test_a_crashed_process_is_restarted_after_its_backoff_and_the_others_are_left_alone(tmp_path):
    supervisor, clock, lines, launched = supervised(tmp_path)
    router = supervisor.watched["router"].process
    entry = crash(supervisor, clock)
    assert entry.state == "restarting" and launched == []
    clock.now += 0.5
    supervisor.check()
    assert launched == []                                  # still inside the 1 s backoff
    clock.now += 0.6
    supervisor.check()
    assert launched == ["cpu/worker-0"] and entry.state == "running" and entry.restarts == 1
    assert supervisor.watched["router"].process is router
    assert "restarting in 1 s" in lines[0] and "restarted" in lines[1]
    rows = {r["name"]: r for r in read_status(tmp_path / "processes.json")}
    assert rows["cpu/worker-0"] == {"name": "cpu/worker-0", "pid": entry.process.pid, "state": "running",
                                    "restarts": 1, "last_exit_code": -9}
    assert rows["router"]["restarts"] == 0


def test_backoff_doubles_with_crashes_in_a_row_and_is_capped(tmp_path):
    policy = RestartPolicy(first_delay_s=1, max_delay_s=4, crash_limit=100, window_s=60)
    supervisor, clock, lines, launched = supervised(tmp_path, policy)
    delays = []
    for _ in range(4):
        entry = crash(supervisor, clock)
        delays.append(entry.restart_at - clock.now)
        clock.now = entry.restart_at
        supervisor.check()
    assert delays == [1, 2, 4, 4] and len(launched) == 4


def test_a_healthy_run_resets_the_backoff(tmp_path):
    supervisor, clock, lines, launched = supervised(tmp_path)
    entry = crash(supervisor, clock)
    clock.now = entry.restart_at
    supervisor.check()
    clock.now += 61                                       # ran longer than the window
    entry = crash(supervisor, clock)
    assert entry.restart_at - clock.now == 1 and entry.in_a_row == 1


def test_repeated_crashes_within_the_window_stop_only_that_process_loudly(tmp_path):
    supervisor, clock, lines, launched = supervised(tmp_path)
    for _ in range(3):
        entry = crash(supervisor, clock)
        clock.now = entry.restart_at
        supervisor.check()
    entry = crash(supervisor, clock)                      # the 4th within 60 s
    assert entry.state == "stopped" and "NOT restarting" in lines[-1]
    clock.now += 1000
    supervisor.check()
    assert entry.state == "stopped" and len(launched) == 3
    assert supervisor.watched["router"].state == "running"
    rows = {r["name"]: r for r in read_status(tmp_path / "processes.json")}
    assert rows["cpu/worker-0"]["state"] == "stopped" and rows["cpu/worker-0"]["restarts"] == 3


def test_crashes_spread_beyond_the_window_never_give_up(tmp_path):
    supervisor, clock, lines, launched = supervised(tmp_path)
    for _ in range(10):
        entry = crash(supervisor, clock)
        clock.now = entry.restart_at
        supervisor.check()
        clock.now += 30                                   # two crashes per minute, limit 4 per minute
    assert entry.state == "running" and len(launched) == 10


def test_read_status_without_a_file_or_with_a_broken_one(tmp_path):
    assert read_status(tmp_path / "missing.json") == []
    (tmp_path / "broken.json").write_text("{not json")
    assert read_status(tmp_path / "broken.json") == []
