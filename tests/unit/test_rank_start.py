"""How ranks start: forked from one forkserver while the import-time environment holds, spawned when it changed."""

from __future__ import annotations

import os

import pytest

from runtime import rank_start


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(rank_start, "_forkserver_env", None)


def test_cpu_ranks_fork_from_the_forkserver_until_an_import_time_variable_changes(fresh, monkeypatch):
    monkeypatch.delenv("EAGLEGATE_CPU_CLASS", raising=False)
    assert rank_start.rank_context("cpu").get_start_method() == "forkserver"
    monkeypatch.setenv("EAGLEGATE_SOME_UNRELATED_NAME_IN_THE_TEST", "1")  # not what the forkserver imported under
    assert rank_start.rank_context("cpu").get_start_method() == "spawn"
    monkeypatch.delenv("EAGLEGATE_SOME_UNRELATED_NAME_IN_THE_TEST")
    monkeypatch.setenv("HOME_OF_SOMETHING_ELSE", "/x")  # read at run time: the rank adopts the engine's value
    assert rank_start.rank_context("cpu").get_start_method() == "forkserver"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert rank_start.rank_context("cpu").get_start_method() == "spawn"


def test_gpu_ranks_are_always_spawned(fresh):
    assert rank_start.rank_context("cuda").get_start_method() == "spawn"


def test_a_rank_takes_the_engines_environment():
    saved = dict(os.environ)
    os.environ["EAGLEGATE_TEST_STALE"] = "the forkserver's"
    try:
        rank_start.begin_rank({"EAGLEGATE_TEST_FRESH": "the engine's", "PATH": "/bin"})
        assert dict(os.environ) == {"EAGLEGATE_TEST_FRESH": "the engine's", "PATH": "/bin"}
    finally:
        os.environ.clear()
        os.environ.update(saved)
