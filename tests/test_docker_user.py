"""Dockerfile.nvidia's user setup (docker/create-user.sh) against Ubuntu 24.04 and 22.04 account files.

Docker cannot build images here, so the script runs with ``ROOT`` pointing at a directory holding a
base image's /etc/passwd, group, shadow and gshadow, and the real shadow-utils tools edit those
files through ``--prefix``. The listings are those of the ``ubuntu:24.04`` base image (NGC 25.xx
images build on it: user and group ``ubuntu`` with id 1000, home /home/ubuntu) and ``ubuntu:22.04``
(no id 1000), written out below. What this does not check: the rest of the image build (pip inside
an NGC image), which needs Docker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docker" / "create-user.sh"

_SYSTEM_USERS = """\
root:x:0:0:root:/root:/bin/bash
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
bin:x:2:2:bin:/bin:/usr/sbin/nologin
sys:x:3:3:sys:/dev:/usr/sbin/nologin
sync:x:4:65534:sync:/bin:/bin/sync
games:x:5:60:games:/usr/games:/usr/sbin/nologin
man:x:6:12:man:/var/cache/man:/usr/sbin/nologin
lp:x:7:7:lp:/var/spool/lpd:/usr/sbin/nologin
mail:x:8:8:mail:/var/mail:/usr/sbin/nologin
news:x:9:9:news:/var/spool/news:/usr/sbin/nologin
uucp:x:10:10:uucp:/var/spool/uucp:/usr/sbin/nologin
proxy:x:13:13:proxy:/bin:/usr/sbin/nologin
www-data:x:33:33:www-data:/var/www:/usr/sbin/nologin
backup:x:34:34:backup:/var/backups:/usr/sbin/nologin
list:x:38:38:Mailing List Manager:/var/list:/usr/sbin/nologin
irc:x:39:39:ircd:/run/ircd:/usr/sbin/nologin
_apt:x:42:65534::/nonexistent:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
"""
_SYSTEM_GROUPS = """\
root:x:0:
daemon:x:1:
bin:x:2:
sys:x:3:
adm:x:4:
tty:x:5:
disk:x:6:
lp:x:7:
mail:x:8:
news:x:9:
uucp:x:10:
man:x:12:
proxy:x:13:
kmem:x:15:
dialout:x:20:
fax:x:21:
voice:x:22:
cdrom:x:24:
floppy:x:25:
tape:x:26:
sudo:x:27:
audio:x:29:
dip:x:30:
www-data:x:33:
backup:x:34:
operator:x:37:
list:x:38:
irc:x:39:
src:x:40:
shadow:x:42:
utmp:x:43:
video:x:44:
sasl:x:45:
plugdev:x:46:
staff:x:50:
games:x:60:
users:x:100:
nogroup:x:65534:
"""
UBUNTU_24_04 = {
    "passwd": _SYSTEM_USERS + "ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash\n",
    "group": _SYSTEM_GROUPS + "ubuntu:x:1000:\n",
}
UBUNTU_22_04 = {"passwd": _SYSTEM_USERS, "group": _SYSTEM_GROUPS}


def _reason_to_skip() -> str | None:
    if os.geteuid() != 0:
        return "the shadow tools write account files only as root"
    for tool in ("useradd", "usermod", "groupmod"):
        if shutil.which(tool) is None:
            return f"{tool} (shadow-utils) is not installed"
    help_text = subprocess.run(["useradd", "--help"], capture_output=True, text=True).stdout
    return None if "--prefix" in help_text else "this useradd has no --prefix"


pytestmark = pytest.mark.skipif(_reason_to_skip() is not None, reason=str(_reason_to_skip()))


def _base_image(tmp_path: Path, listing: dict[str, str], *, supplementary: bool = False) -> Path:
    """A directory with a base image's account files (and /home/ubuntu where the user exists)."""
    root = tmp_path / "root"
    etc = root / "etc"
    etc.mkdir(parents=True)
    passwd, group = listing["passwd"], listing["group"]
    if supplementary:  # the ubuntu user in admin groups, as on cloud images
        group = group.replace("adm:x:4:", "adm:x:4:ubuntu").replace("sudo:x:27:", "sudo:x:27:ubuntu")
    (etc / "passwd").write_text(passwd)
    (etc / "group").write_text(group)
    users = [line.split(":")[0] for line in passwd.splitlines()]
    groups = [line.split(":")[0] for line in group.splitlines()]
    (etc / "shadow").write_text("".join(f"{u}:*:19800:0:99999:7:::\n" for u in users))
    (etc / "gshadow").write_text("".join(f"{g}:*::\n" for g in groups))
    for name in ("shadow", "gshadow"):
        (etc / name).chmod(0o640)
    shutil.copy("/etc/login.defs", etc / "login.defs")
    (root / "home").mkdir()
    (root / "var" / "mail").mkdir(parents=True)
    if "ubuntu:" in passwd:
        home = root / "home" / "ubuntu"
        home.mkdir()
        (home / ".bashrc").write_text("# ubuntu's\n")
        os.chown(home, 1000, 1000)
    return root


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROOT": str(root)}
    return subprocess.run(["sh", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def _entries(root: Path, name: str) -> dict[str, list[str]]:
    lines = (root / "etc" / name).read_text().splitlines()
    return {line.split(":")[0]: line.split(":") for line in lines if line}


def _check_cosy(root: Path) -> None:
    users, groups = _entries(root, "passwd"), _entries(root, "group")
    assert users["cosy"][2:4] == ["1000", "1000"] and users["cosy"][5] == "/home/cosy", users["cosy"]
    assert groups["cosy"][2] == "1000", groups["cosy"]
    assert [u for u, entry in users.items() if entry[2] == "1000"] == ["cosy"]
    assert "cosy" in _entries(root, "shadow") and "cosy" in _entries(root, "gshadow")
    home = root / "home" / "cosy"
    assert home.is_dir() and home.stat().st_uid == 1000, home
    assert (home / ".bashrc").is_file()


def test_the_old_line_fails_on_an_ubuntu_24_04_base(tmp_path):
    """The fixture reproduces issue 19 item 1: `useradd --uid 1000 cosy` on ubuntu:24.04."""
    root = _base_image(tmp_path, UBUNTU_24_04)
    result = subprocess.run(
        ["useradd", "--prefix", str(root), "--create-home", "--uid", "1000", "cosy"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "not unique" in result.stderr, result


@pytest.mark.parametrize("supplementary", [False, True])
def test_ubuntu_24_04_renames_the_ubuntu_account(tmp_path, supplementary):
    root = _base_image(tmp_path, UBUNTU_24_04, supplementary=supplementary)
    result = _run(root, "cosy", "1000")
    assert result.returncode == 0, result.stderr
    _check_cosy(root)
    for name in ("passwd", "group", "shadow", "gshadow"):
        assert "ubuntu" not in _entries(root, name), name
    assert (root / "home" / "cosy" / ".bashrc").read_text() == "# ubuntu's\n"  # moved, not recreated
    assert not (root / "home" / "ubuntu").exists()
    if supplementary:
        groups = _entries(root, "group")
        assert groups["adm"][3] == "cosy" and groups["sudo"][3] == "cosy", groups
    again = _run(root, "cosy", "1000")
    assert again.returncode == 0 and "exists" in again.stdout, again


def test_ubuntu_22_04_creates_the_account(tmp_path):
    root = _base_image(tmp_path, UBUNTU_22_04)
    result = _run(root, "cosy", "1000")
    assert result.returncode == 0, result.stderr
    _check_cosy(root)  # (useradd --prefix fills the home from the host's /etc/skel)


def test_the_dockerfile_runs_the_script():
    dockerfile = (ROOT / "Dockerfile.nvidia").read_text()
    assert "COPY docker/create-user.sh" in dockerfile and "create-user.sh cosy 1000" in dockerfile
    code = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if "useradd" in line], "the user is made by the script only"


@pytest.mark.parametrize(
    ("cuda_version", "pin"), [("12.9.1", "cuda-python>=12.6.1,<13"), ("13.0.0", "cuda-python>=13")]
)
def test_the_dockerfile_pins_cuda_python_to_the_images_cuda(cuda_version, pin):
    """cuda-python 13 on a CUDA 12 image would need a driver >= 580 (issue 19 item 2)."""
    line = next(
        line
        for line in (ROOT / "Dockerfile.nvidia").read_text().splitlines()
        if 'case "${CUDA_VERSION' in line
    )
    command = line.strip().rstrip("\\").strip() + ' printf %s "$cuda_python"'
    result = subprocess.run(
        ["sh", "-c", command], env={"CUDA_VERSION": cuda_version}, capture_output=True, text=True
    )
    assert result.stdout == pin, (result, command)
