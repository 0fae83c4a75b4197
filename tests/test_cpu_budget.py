"""The CPU budget (``runtime/cpu_budget``) read from fake /sys and /proc trees, and the replica plans it makes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trt_cosy.errors import InputError
from trt_cosy.runtime import cpu_budget
from trt_cosy.runtime.cpu_budget import claim_slot, format_cpu_list, parse_cpu_list, read_budget, read_quota


def fake_machine(root: Path, sockets: int, cores: int, smt: int) -> list[int]:
    """A Linux-numbered topology: CPU ``t * sockets * cores + s * cores + c`` is thread t of core c of
    socket s (siblings are ``sockets * cores`` apart, as the kernel numbers Xeons); one NUMA node per
    socket. Returns every CPU."""
    per_thread = sockets * cores
    node_cpus: dict[int, list[int]] = {}
    for thread in range(smt):
        for socket in range(sockets):
            for core in range(cores):
                cpu = thread * per_thread + socket * cores + core
                topology = root / "sys/devices/system/cpu" / f"cpu{cpu}" / "topology"
                topology.mkdir(parents=True)
                (topology / "physical_package_id").write_text(f"{socket}\n")
                (topology / "core_id").write_text(f"{core}\n")
                siblings = [t * per_thread + socket * cores + core for t in range(smt)]
                (topology / "thread_siblings_list").write_text(format_cpu_list(siblings) + "\n")
                node_cpus.setdefault(socket, []).append(cpu)
    for node, cpus in node_cpus.items():
        node_dir = root / "sys/devices/system/node" / f"node{node}"
        node_dir.mkdir(parents=True)
        (node_dir / "cpulist").write_text(format_cpu_list(cpus) + "\n")
    return sorted(cpu for cpus in node_cpus.values() for cpu in cpus)


def cgroup_v1(root: Path, path: str, quota_us: int, period_us: int = 100000) -> None:
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cgroup").write_text(
        f"12:memory:{path}\n4:cpu,cpuacct:{path}\n1:name=systemd:{path}\n0::/\n"
    )
    (root / "proc/self/mountinfo").write_text(
        "31 23 0:28 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
        "34 31 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    )
    top = root / "sys/fs/cgroup/cpu,cpuacct"
    here = top / path.strip("/")
    here.mkdir(parents=True)
    (top / "cpu.cfs_quota_us").write_text("-1\n")
    (top / "cpu.cfs_period_us").write_text("100000\n")
    (here / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (here / "cpu.cfs_period_us").write_text(f"{period_us}\n")


def cgroup_v2(root: Path, path: str, cpu_max: str, parent_max: str = "max 100000") -> None:
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cgroup").write_text(f"0::{path}\n")
    (root / "proc/self/mountinfo").write_text(
        "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    here = root / "sys/fs/cgroup" / path.strip("/")
    here.mkdir(parents=True)
    (here / "cpu.max").write_text(f"{cpu_max}\n")
    (here.parent / "cpu.max").write_text(f"{parent_max}\n")


def test_cpu_list_format_round_trips() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert parse_cpu_list("") == []


def test_two_sockets_of_eight_cores_with_smt(tmp_path: Path) -> None:
    cpus = fake_machine(tmp_path, sockets=2, cores=8, smt=2)
    budget = read_budget(tmp_path, affinity=cpus)
    assert len(budget.cpus) == 32 and len(budget.cores) == 16 and budget.nodes == (0, 1)
    assert budget.quota_cpus is None and budget.usable_cores == 16 and budget.default_threads == 16
    assert budget.smt == 2
    # Core 0 of socket 0 is CPUs 0 and 16; socket 1's cores are CPUs 8-15 and 24-31.
    assert budget.cores[0].cpus == (0, 16) and budget.cores[8].cpus == (8, 24) and budget.cores[8].node == 1

    two = budget.plan(2)
    assert not two.shared and two.threads == 8
    assert [slot.cpus for slot in two.slots] == [(*range(0, 8), *range(16, 24)), (*range(8, 16), *range(24, 32))]
    assert [slot.nodes for slot in two.slots] == [(0,), (1,)]

    four = budget.plan(4)
    assert [slot.threads for slot in four.slots] == [4, 4, 4, 4]
    assert [slot.nodes for slot in four.slots] == [(0,), (0,), (1,), (1,)]
    assert [slot.cpus for slot in four.slots][1] == (4, 5, 6, 7, 20, 21, 22, 23)
    _assert_disjoint(four)

    # 3 replicas of 5 cores: two fit in a node each, the third takes the rest of both nodes.
    three = budget.plan(3)
    assert [slot.threads for slot in three.slots] == [5, 5, 5]
    assert [slot.nodes for slot in three.slots] == [(0,), (1,), (0, 1)]
    _assert_disjoint(three)

    sixteen = budget.plan(16)
    assert all(slot.threads == 1 and len(slot.cpus) == 2 for slot in sixteen.slots)
    _assert_disjoint(sixteen)

    # Explicit threads: 3 replicas of 2 cores each fit in node 0.
    assert [slot.nodes for slot in budget.plan(3, threads=2).slots] == [(0,), (0,), (0,)]


def _assert_disjoint(plan) -> None:
    seen: set[int] = set()
    for slot in plan.slots:
        assert not seen & set(slot.cpus)
        seen |= set(slot.cpus)


def test_more_replicas_than_cores_share_them(tmp_path: Path) -> None:
    cpus = fake_machine(tmp_path, sockets=1, cores=2, smt=1)
    plan = read_budget(tmp_path, affinity=cpus).plan(3)
    assert plan.shared and [slot.cpus for slot in plan.slots] == [(0,), (1,), (0,)]
    assert [slot.threads for slot in plan.slots] == [1, 1, 1]
    with pytest.raises(InputError, match="replicas"):
        read_budget(tmp_path, affinity=cpus).plan(0)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_four_cpu_quota_on_a_64_core_host(tmp_path: Path, version: str) -> None:
    cpus = fake_machine(tmp_path, sockets=2, cores=32, smt=1)
    if version == "v1":
        cgroup_v1(tmp_path, "/kubepods/burstable/pod1234/abcd", quota_us=400000)
    else:
        cgroup_v2(tmp_path, "/kubepods.slice/pod1234.slice/cri-abcd.scope", "400000 100000")
    budget = read_budget(tmp_path, affinity=cpus)
    assert len(budget.cores) == 64 and budget.quota_cpus == pytest.approx(4.0)
    assert budget.usable_cores == 4 and budget.default_threads == 4

    one = budget.plan(1)
    assert one.threads == 4 and one.slots[0].cpus == (0, 1, 2, 3)
    two = budget.plan(2)
    assert [slot.cpus for slot in two.slots] == [(0, 1), (2, 3)] and two.threads == 2 and not two.shared
    four = budget.plan(4)
    assert [slot.cpus for slot in four.slots] == [(0,), (1,), (2,), (3,)]
    assert budget.plan(8).shared


def test_the_tightest_quota_on_the_way_up_counts(tmp_path: Path) -> None:
    cgroup_v2(tmp_path, "/outer/inner", "max 100000", parent_max="150000 100000")
    assert read_quota(tmp_path) == pytest.approx(1.5)
    (tmp_path / "sys/fs/cgroup/outer/inner/cpu.max").write_text("50000 100000\n")
    assert read_quota(tmp_path) == pytest.approx(0.5)
    fake_machine(tmp_path, sockets=1, cores=4, smt=1)
    assert read_budget(tmp_path, affinity=range(4)).default_threads == 1  # half a CPU still runs one thread


def test_a_fractional_v1_quota_and_no_quota(tmp_path: Path) -> None:
    fake_machine(tmp_path, sockets=1, cores=8, smt=2)
    cgroup_v1(tmp_path, "/docker/0123", quota_us=250000)  # docker --cpus 2.5
    budget = read_budget(tmp_path, affinity=range(16))
    assert budget.quota_cpus == pytest.approx(2.5) and budget.usable_cores == 2
    (tmp_path / "sys/fs/cgroup/cpu,cpuacct/docker/0123/cpu.cfs_quota_us").write_text("-1\n")
    assert read_budget(tmp_path, affinity=range(16)).usable_cores == 8


def test_a_container_whose_cgroup_is_its_mount_root(tmp_path: Path) -> None:
    """Docker without a cgroup namespace: /proc/self/cgroup names the host path, the mount is its root."""
    fake_machine(tmp_path, sockets=1, cores=8, smt=1)
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("3:cpu,cpuacct:/docker/feed\n")
    (tmp_path / "proc/self/mountinfo").write_text(
        "40 31 0:33 /docker/feed /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpuacct,cpu\n"
    )
    top = tmp_path / "sys/fs/cgroup/cpu,cpuacct"
    top.mkdir(parents=True)
    (top / "cpu.cfs_quota_us").write_text("200000\n")
    (top / "cpu.cfs_period_us").write_text("100000\n")
    assert read_budget(tmp_path, affinity=range(8)).usable_cores == 2


def test_a_restricted_affinity_mask(tmp_path: Path) -> None:
    """taskset -c 2-5,18-21 on 2 x 8 x 2: four whole cores of node 0; a lone sibling (CPU 22) is a core too."""
    fake_machine(tmp_path, sockets=2, cores=8, smt=2)
    budget = read_budget(tmp_path, affinity=[2, 3, 4, 5, 18, 19, 20, 21])
    assert [core.cpus for core in budget.cores] == [(2, 18), (3, 19), (4, 20), (5, 21)]
    assert budget.nodes == (0,) and budget.default_threads == 4
    plan = budget.plan(2)
    assert [slot.cpus for slot in plan.slots] == [(2, 3, 18, 19), (4, 5, 20, 21)]
    assert plan.threads == 2

    spread = read_budget(tmp_path, affinity=[6, 7, 8, 9, 22])
    assert [core.cpus for core in spread.cores] == [(6, 22), (7,), (8,), (9,)]
    assert [slot.nodes for slot in spread.plan(2).slots] == [(0,), (1,)]


def test_no_sysfs_assumes_two_way_smt(tmp_path: Path) -> None:
    budget = read_budget(tmp_path, affinity=range(8))
    assert not budget.topology_known and budget.default_threads == 4 and budget.quota_cpus is None


def test_this_machine_reads_without_error() -> None:
    budget = read_budget()
    assert set(budget.cpus) == os.sched_getaffinity(0)
    assert 1 <= budget.default_threads <= len(budget.cpus)
    assert budget.describe()


def test_claimed_slots_are_disjoint_and_freed_when_the_holder_exits(tmp_path: Path) -> None:
    fake_machine(tmp_path, sockets=1, cores=4, smt=1)
    plan = read_budget(tmp_path, affinity=range(4)).plan(2)
    locks = tmp_path / "locks"
    holder = (
        "import sys, time; from pathlib import Path; from trt_cosy.runtime.cpu_budget import read_budget, claim_slot\n"
        f"plan = read_budget({str(tmp_path)!r}, affinity=range(4)).plan(2)\n"
        f"slot = claim_slot(plan, 'app', {str(locks)!r}); print(slot.index, flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "0"
        mine = claim_slot(plan, "app", locks)
        assert mine is not None and mine.index == 1 and mine.cpus == (2, 3)
        assert claim_slot(plan, "other-app", locks).index == 0  # another key has its own slots
    finally:
        child.stdin.close()
        child.wait(60)
    assert claim_slot(plan, "app", locks).index == 0  # the holder exited: its slot is free again
    while cpu_budget._held_slots:  # noqa: SLF001 - drop this test's locks (closing a file frees its lock)
        cpu_budget._held_slots.pop().close()


def test_ray_replicas_reserve_the_cpus_they_pin(tmp_path: Path) -> None:
    from trt_cosy.serving.ray_app import RayServeOptions, cpu_share

    cpus = fake_machine(tmp_path / "smt", sockets=2, cores=8, smt=2)
    budget = read_budget(tmp_path / "smt", affinity=cpus)
    options = RayServeOptions(engines=tmp_path, replicas=2)
    share = cpu_share(options, budget)
    assert (share.threads, share.num_cpus, share.replicas) == (8, 16.0, 2)  # 8 cores with their siblings
    autoscaled = cpu_share(RayServeOptions(engines=tmp_path, autoscale=(1, 4)), budget)
    assert (autoscaled.threads, autoscaled.num_cpus, autoscaled.replicas) == (4, 8.0, 4)  # planned for the max
    crowded = cpu_share(RayServeOptions(engines=tmp_path, replicas=64), budget)
    assert crowded.threads == 1 and crowded.num_cpus == 0.5  # shared cores: an even part of the CPUs

    fake_machine(tmp_path / "pod", sockets=2, cores=32, smt=1)
    cgroup_v2(tmp_path / "pod", "/kubepods/pod", "400000 100000")
    pod = read_budget(tmp_path / "pod", affinity=range(64))
    share = cpu_share(RayServeOptions(engines=tmp_path, replicas=2), pod)
    assert (share.threads, share.num_cpus) == (2, 2.0)
