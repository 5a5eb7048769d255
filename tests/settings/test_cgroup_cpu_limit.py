"""The default worker count honours the cgroup CPU quota as well as the affinity mask: one row
per shape of /proc/self/cgroup and the cgroup files (v2 ``cpu.max``, v1 ``cfs_quota_us``),
written to a temporary tree as the kernel lays them out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relay.settings import Settings, operations
from relay.settings.operations import cgroup_cpu_limit


def tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "sys-fs-cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    root.mkdir(exist_ok=True)
    proc_file = tmp_path / "cgroup"
    proc_file.write_text(proc)
    return proc_file, root


@pytest.mark.parametrize(("proc", "files", "cpus"), [
    pytest.param("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0, id="v2-container-2-cpus"),
    pytest.param("0::/\n", {"cpu.max": "max 100000\n"}, None, id="v2-no-limit"),
    pytest.param("0::/kubepods/pod1/c1\n",
                 {"kubepods/pod1/c1/cpu.max": "max 100000\n",
                  "kubepods/pod1/cpu.max": "150000 100000\n",
                  "kubepods/cpu.max": "max 100000\n"}, 1.5,
                 id="v2-a-parents-limit-holds-its-children"),
    pytest.param("0::/a\n", {"a/cpu.max": "50000 100000\n", "cpu.max": "400000 100000\n"},
                 0.5, id="v2-the-smallest-along-the-ancestry"),
    pytest.param("4:cpu,cpuacct:/docker/x\n0::/\n",
                 {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "300000\n",
                  "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}, 3.0, id="v1-quota"),
    pytest.param("1:cpu:/\n0::/\n", {"cpu/cpu.cfs_quota_us": "-1\n",
                                     "cpu/cpu.cfs_period_us": "100000\n"}, None,
                 id="v1-unlimited"),
    pytest.param("0::/\n", {}, None, id="no-cpu-controller-files"),
    pytest.param("0::/\n", {"cpu.max": "garbage\n"}, None, id="unreadable-files"),
])
def test_the_quota_is_read_as_the_kernel_writes_it(
        tmp_path: Path, proc: str, files: dict[str, str], cpus: float | None) -> None:
    assert cgroup_cpu_limit(*tree(tmp_path, proc, files)) == cpus


def test_no_proc_file_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path / "missing", tmp_path) is None


def test_the_default_workers_are_the_quota_rounded_up_within_the_affinity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(64)))
    monkeypatch.setattr(operations, "cgroup_cpu_limit", lambda: 1.5)
    unset = Settings.model_validate({"upstream": "a.example:25"})
    assert unset.effective_workers == 2
    monkeypatch.setattr(operations, "cgroup_cpu_limit", lambda: None)
    assert unset.effective_workers == 64
    given = Settings.model_validate({"upstream": "a.example:25", "workers": 3})
    assert given.effective_workers == 3
