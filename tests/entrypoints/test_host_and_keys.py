"""CPU threads from the cores really available, and where the API key may come from (issue 22)."""

from __future__ import annotations

import argparse

import pytest

from metrale.config.host import cgroup_cpu_limit
from metrale.entrypoints.server.args import api_key_of
from metrale.startup.cpu_threads import choose_cpu_threads


def test_threads_keep_a_core_for_the_server_and_honour_omp_num_threads():
    assert choose_cpu_threads(2, reserved_cores=1, environ={}) == (1, "2 core(s) available, 1 kept for the "
                                                                      "server's own threads")
    assert choose_cpu_threads(8, reserved_cores=0, environ={})[0] == 8
    assert choose_cpu_threads(1, reserved_cores=1, environ={})[0] == 1  # never zero
    assert choose_cpu_threads(8, reserved_cores=1, ranks=2, environ={})[0] == 3  # (8 - 1) // 2 per rank
    assert choose_cpu_threads(2, reserved_cores=1, environ={"OMP_NUM_THREADS": "4"}) == (4, "OMP_NUM_THREADS")
    assert choose_cpu_threads(2, reserved_cores=1, environ={"OMP_NUM_THREADS": "many"})[0] == 1


def test_cgroup_quota_caps_the_cores(tmp_path):
    v2 = tmp_path / "cpu.max"
    v2.write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(v2)) == 2  # 1.5 CPUs round up
    v2.write_text("max 100000\n")
    assert cgroup_cpu_limit(str(v2)) is None
    quota, period = tmp_path / "quota", tmp_path / "period"
    quota.write_text("400000")
    period.write_text("100000")
    assert cgroup_cpu_limit(str(tmp_path / "none"), str(quota), str(period)) == 4
    quota.write_text("-1")
    assert cgroup_cpu_limit(str(tmp_path / "none"), str(quota), str(period)) is None


def _args(**kwargs):
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kwargs})


def test_api_key_from_flag_file_or_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    assert api_key_of(_args(), environ={}) is None
    assert api_key_of(_args(api_key="sk-flag"), environ={}) == "sk-flag"
    assert api_key_of(_args(api_key_file=str(key_file)), environ={}) == "sk-from-file"
    assert api_key_of(_args(), environ={"MET_API_KEY": "sk-env"}) == "sk-env"


@pytest.mark.parametrize("kwargs,environ,message", [
    ({"api_key": "a"}, {"MET_API_KEY": "b"}, "one way"),
    ({"api_key_file": "/nonexistent/key"}, {}, "cannot read"),
    ({"api_key": " "}, {}, "empty"),
    ({}, {"MET_API_KEY": ""}, "empty"),
])
def test_api_key_mistakes_are_refused(kwargs, environ, message):
    with pytest.raises(ValueError, match=message):
        api_key_of(_args(**kwargs), environ=environ)
