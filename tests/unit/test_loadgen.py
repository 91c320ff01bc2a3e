"""The QoS benchmark's client processes (bench/loadgen.py): a client that dies says so."""
from __future__ import annotations

import multiprocessing
import sys

import pytest

from bench.loadgen import _receive


def test_a_client_that_dies_without_reporting_is_named_with_its_exit_code():
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=sys.exit, args=(3,), name="client-low")
    process.start()
    theirs.close()            # the child's end is now held by the child alone
    process.join(timeout=60)
    with pytest.raises(RuntimeError, match="client-low exited with 3 without reporting"):
        _receive(process, ours)
