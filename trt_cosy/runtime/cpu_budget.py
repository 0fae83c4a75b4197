"""The CPU budget of this process, read from the machine, and the plan that shares it among replicas.

What the engines may use is the smallest of three limits, read in one place for the runtime, the server
(``serve --workers``), Ray replicas and Triton instances:

- the affinity mask (``os.sched_getaffinity``: ``taskset``, a cgroup cpuset, a pinned replica);
- whole physical cores: SMT siblings (``/sys/devices/system/cpu/cpuN/topology``) share one core's FMA
  units, so a second thread per core only adds contention to kernels that already saturate them;
- the cgroup CPU quota (``docker --cpus``, Kubernetes limits): v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``,
  v2 ``cpu.max``, found through ``/proc/self/cgroup`` and ``/proc/self/mountinfo``. A quota does not shrink
  the affinity mask, so without it a 2-CPU pod on a 64-core node would start 32 threads per graph.

NUMA nodes come from ``/sys/devices/system/node/nodeN/cpulist``. ``CpuBudget.plan(n)`` gives ``n``
replicas disjoint sets of whole cores, each within one NUMA node where they fit, and as many threads per
graph as cores. The ``root`` argument of ``read_budget`` points at a fake ``/`` (tests).

This module is a leaf: it imports nothing from trt-cosy but the errors.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from ..errors import InputError

__all__ = [
    "Core", "CpuBudget", "ReplicaSlot", "ReplicaPlan", "read_budget", "default_threads", "parse_cpu_list",
    "pin_process", "claim_slot", "pin_replica"
]

_LOGGER = logging.getLogger(__name__)
_CPU_DIR: Final = "sys/devices/system/cpu"
_NODE_DIR: Final = "sys/devices/system/node"
# A quota of 3.99999 CPUs (rounding in the period arithmetic) still buys 4 cores.
_QUOTA_SLACK: Final = 1e-3
_held_slots: list[IO[bytes]] = []  # the lock files of claimed slots, open for the process's life


@dataclass(frozen=True)
class Core:
    """One physical core: the logical CPUs of it this process may use, and its NUMA node."""

    cpus: tuple[int, ...]
    node: int


@dataclass(frozen=True)
class ReplicaSlot:
    """One replica's share: whole cores (all in one NUMA node where they fit) and its threads per graph."""

    index: int
    cores: tuple[Core, ...]

    @property
    def cpus(self) -> tuple[int, ...]:
        """The logical CPUs to pin the replica to (every usable SMT sibling of its cores)."""
        return tuple(sorted(cpu for core in self.cores for cpu in core.cpus))

    @property
    def threads(self) -> int:
        """Intra-op threads per graph: one per physical core."""
        return len(self.cores)

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({core.node for core in self.cores}))


@dataclass(frozen=True)
class ReplicaPlan:
    """How ``len(slots)`` replicas share the budget; ``shared`` when there are more replicas than cores
    (slots then repeat cores: the replicas will contend)."""

    slots: tuple[ReplicaSlot, ...]
    shared: bool

    @property
    def threads(self) -> int:
        return self.slots[0].threads

    def describe(self) -> str:
        parts = [f"{slot.index}: cpus {format_cpu_list(slot.cpus)} (node {','.join(map(str, slot.nodes))}, "
                 f"{slot.threads} thread{'s' if slot.threads > 1 else ''})" for slot in self.slots]
        return "; ".join(parts) + (" [more replicas than cores: they share cores]" if self.shared else "")


@dataclass(frozen=True)
class CpuBudget:
    """The physical cores this process may use, and the cgroup quota (CPUs) over them."""

    cores: tuple[Core, ...]
    """Usable physical cores, ordered by NUMA node then first CPU."""
    quota_cpus: float | None = None
    """The tightest cgroup CPU quota on the way to the root, in CPUs; None: no quota."""
    topology_known: bool = True
    """False where sysfs is missing: logical CPUs were paired as assumed 2-way SMT siblings."""

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(cpu for core in self.cores for cpu in core.cpus))

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({core.node for core in self.cores}))

    @property
    def usable_cores(self) -> int:
        """Cores' worth of compute: the physical cores, capped by the quota (at least 1)."""
        cores = len(self.cores)
        if self.quota_cpus is not None:
            cores = min(cores, math.floor(self.quota_cpus + _QUOTA_SLACK))
        return max(1, cores)

    @property
    def default_threads(self) -> int:
        """Intra-op threads for one engine alone: one per usable core."""
        return self.usable_cores

    @property
    def smt(self) -> int:
        """Logical CPUs per core (the largest seen): what a pinned core costs in a CPU scheduler's units."""
        return max(len(core.cpus) for core in self.cores)

    def plan(self, replicas: int, threads: int | None = None) -> ReplicaPlan:
        """Disjoint sets of whole cores for ``replicas`` engines, each within one NUMA node where it fits.

        Each replica gets ``threads`` cores (default: the usable cores divided evenly, at least 1).
        Where ``replicas * threads`` exceeds the usable cores the slots repeat cores (``shared``).
        """
        if replicas < 1:
            raise InputError(f"replicas must be >= 1, got {replicas}.")
        budget = self.usable_cores
        per_replica = max(1, budget // replicas) if threads is None else int(threads)
        if per_replica < 1:
            raise InputError(f"threads must be >= 1, got {threads}.")
        per_replica = min(per_replica, budget)
        fitting = budget // per_replica
        slots = _allocate(self.cores, min(replicas, fitting), per_replica)
        shared = replicas > fitting
        while len(slots) < replicas:  # more replicas than whole shares: reuse the shares in turn
            source = slots[len(slots) % fitting]
            slots.append(ReplicaSlot(len(slots), source.cores))
        return ReplicaPlan(tuple(slots), shared)

    def describe(self) -> str:
        quota = "no quota" if self.quota_cpus is None else f"quota {self.quota_cpus:g} CPUs"
        return (f"{len(self.cores)} physical cores ({len(self.cpus)} CPUs: {format_cpu_list(self.cpus)}) on "
                f"{len(self.nodes)} NUMA node(s), {quota}: {self.usable_cores} usable")


def _allocate(cores: Sequence[Core], replicas: int, per_replica: int) -> list[ReplicaSlot]:
    """First fit per NUMA node; a replica that fits in no node's free cores takes the fullest nodes' rest."""
    free: dict[int, list[Core]] = {}
    for core in cores:
        free.setdefault(core.node, []).append(core)
    slots = []
    for index in range(replicas):
        node = next((node for node, left in free.items() if len(left) >= per_replica), None)
        if node is not None:
            taken, free[node] = free[node][:per_replica], free[node][per_replica:]
        else:
            taken = []
            for node in sorted(free, key=lambda key: -len(free[key])):
                need = per_replica - len(taken)
                taken += free[node][:need]
                free[node] = free[node][need:]
        slots.append(ReplicaSlot(index, tuple(taken)))
    return slots


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``."""
    ordered, ranges = sorted(set(cpus)), []
    for cpu in ordered:
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _numa_nodes(root: Path) -> dict[int, int]:
    """cpu -> NUMA node (empty when the kernel has no node directory)."""
    node_of: dict[int, int] = {}
    node_dir = root / _NODE_DIR
    if not node_dir.is_dir():
        return node_of
    for entry in node_dir.iterdir():
        if not (entry.name.startswith("node") and entry.name[4:].isdigit()):
            continue
        text = _read(entry / "cpulist")
        for cpu in parse_cpu_list(text) if text else ():
            node_of[cpu] = int(entry.name[4:])
    return node_of


def _cores(cpus: Sequence[int], root: Path) -> tuple[tuple[Core, ...], bool]:
    """Group ``cpus`` into physical cores by (package, core id); pairs of CPUs where sysfs is missing."""
    cpu_dir = root / _CPU_DIR
    node_of = _numa_nodes(root)
    groups: dict[tuple[str, ...], list[int]] = {}
    known = True
    for cpu in cpus:
        topology = cpu_dir / f"cpu{cpu}" / "topology"
        package, core_id = _read(topology / "physical_package_id"), _read(topology / "core_id")
        if package is not None and core_id is not None:
            key: tuple[str, ...] = ("core", package, core_id)
        else:
            siblings = _read(topology / "thread_siblings_list")
            if siblings is None:
                known = False
                break
            key = ("siblings", siblings)
        groups.setdefault(key, []).append(cpu)
    if not known:  # no sysfs (not Linux, a sandbox): assume 2-way SMT over the mask, in order
        groups = {("pair", str(index)): list(cpus[index:index + 2]) for index in range(0, len(cpus), 2)}
    cores = [Core(tuple(sorted(members)), node_of.get(min(members), 0)) for members in groups.values()]
    cores.sort(key=lambda core: (core.node, core.cpus[0]))
    return tuple(cores), known


def _mounts(root: Path) -> list[tuple[str, str, str, set[str]]]:
    """(root within the hierarchy, mount point, fs type, super options) of each cgroup mount."""
    text = _read(root / "proc/self/mountinfo")
    mounts = []
    for line in (text or "").splitlines():
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        mounts.append((fields[3], fields[4], rest[0], set(rest[2].split(","))))
    if not mounts:  # no mountinfo: the usual places
        mounts = [("/", "/sys/fs/cgroup", "cgroup2", set()),
                  ("/", "/sys/fs/cgroup/cpu,cpuacct", "cgroup", {"cpu"}),
                  ("/", "/sys/fs/cgroup/cpu", "cgroup", {"cpu"})]
    return mounts


def _cgroup_dirs(root: Path, mount_root: str, mount_point: str, path: str) -> list[Path]:
    """This process's cgroup directory under a mount, then each parent up to the mount point."""
    base = root / mount_point.lstrip("/")
    relative = path
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
        relative = path[len(mount_root):]
    elif mount_root != "/":
        relative = "/"  # a container's view of a host path it cannot see: its own root is its cgroup
    here = base / relative.strip("/") if relative.strip("/") else base
    if not here.is_dir():
        here = base
    dirs = [here]
    while here != base and base in here.parents:
        here = here.parent
        dirs.append(here)
    return dirs


def _v1_quota(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    try:
        if quota is not None and period is not None and int(quota) > 0 and int(period) > 0:
            return int(quota) / int(period)
    except ValueError:
        pass
    return None


def _v2_quota(directory: Path) -> float | None:
    fields = (_read(directory / "cpu.max") or "").split()
    try:
        if len(fields) == 2 and fields[0] != "max" and int(fields[1]) > 0:
            return int(fields[0]) / int(fields[1])
    except ValueError:
        pass
    return None


def read_quota(root: Path = Path("/")) -> float | None:
    """The tightest CPU quota (in CPUs) over this process's cgroup and its ancestors, v1 and v2; None if none."""
    text = _read(root / "proc/self/cgroup")
    if text is None:
        return None
    quotas = []
    mounts = _mounts(root)
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            wanted, reader = [m for m in mounts if m[2] == "cgroup2"], _v2_quota
        elif "cpu" in controllers.split(","):
            wanted, reader = [m for m in mounts if m[2] == "cgroup" and "cpu" in m[3]], _v1_quota
        else:
            continue
        for mount_root, mount_point, _, _ in wanted:
            for directory in _cgroup_dirs(root, mount_root, mount_point, path or "/"):
                quota = reader(directory)
                if quota is not None:
                    quotas.append(quota)
    return min(quotas) if quotas else None


def read_budget(root: str | Path = "/", affinity: Iterable[int] | None = None) -> CpuBudget:
    """This process's CPU budget: ``affinity`` (default: its affinity mask) grouped into physical cores
    and NUMA nodes from ``root``/sys, and the cgroup quota from ``root``/proc and the cgroup mounts."""
    root = Path(root)
    cpus = sorted(set(affinity)) if affinity is not None else _affinity()
    cores, known = _cores(cpus, root)
    return CpuBudget(cores=cores, quota_cpus=read_quota(root), topology_known=known)


def default_threads() -> int:
    """Intra-op threads per graph for an engine in this process: its usable cores (at least 1).

    Inside a pinned replica that is the replica's cores; in a container with a quota, at most the quota.
    """
    return read_budget().default_threads


def pin_process(cpus: Iterable[int]) -> None:
    """Pin every thread of this process (and the threads it starts later) to ``cpus``.

    ``sched_setaffinity(0)`` sets only the calling thread; threads already running (a Ray worker's,
    a BLAS pool) are pinned one by one through ``/proc/self/task``.
    """
    wanted = set(cpus)
    os.sched_setaffinity(0, wanted)
    try:
        tasks = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return
    for task in tasks:
        try:
            os.sched_setaffinity(task, wanted)
        except OSError:  # a thread that just ended
            pass


def claim_slot(plan: ReplicaPlan, key: str, lock_dir: str | Path | None = None) -> ReplicaSlot | None:
    """Take the first free slot of ``plan`` on this machine, for replicas that do not know their index
    (Ray replicas, Triton instances): a slot is held by an exclusive lock on a file named after ``key``
    and the slot, released by the kernel when the holder exits (a restarted replica takes it back).

    Returns None when every slot is held (more replicas than the plan has: the caller runs unpinned).
    """
    directory = Path(lock_dir) if lock_dir is not None else Path(tempfile.gettempdir()) / f"trt-cosy-cpus-{os.getuid()}"
    directory.mkdir(parents=True, exist_ok=True)
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in key)
    for slot in plan.slots:
        handle = open(directory / f"{safe}-of{len(plan.slots)}-slot{slot.index}.lock", "ab")  # noqa: SIM115
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        _held_slots.append(handle)
        return slot
    return None


def pin_replica(replicas: int, threads: int | None, key: str) -> ReplicaSlot | None:
    """Claim this replica's slot of ``read_budget().plan(replicas, threads)`` (``claim_slot`` on ``key``)
    and pin this process to its cores; the caller loads its engines with ``slot.threads``.

    None (and no pinning) when every slot is held: more replicas on this machine than planned.
    """
    budget = read_budget()
    plan = budget.plan(replicas, threads)
    slot = claim_slot(plan, key)
    if slot is None:
        _LOGGER.warning("%s: all %d CPU slots on this machine are taken; this replica runs unpinned", key,
                        len(plan.slots))
        return None
    pin_process(slot.cpus)
    _LOGGER.info("%s: replica slot %d of %d pinned to CPUs %s, %d thread(s) per graph%s", key, slot.index,
                 len(plan.slots), format_cpu_list(slot.cpus), slot.threads,
                 " (sharing cores: more replicas than cores)" if plan.shared else "")
    return slot
