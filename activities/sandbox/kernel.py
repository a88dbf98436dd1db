"""The sandbox's kernel-enforced layers: a private filesystem view, private IPC and PID
namespaces, a seccomp filter, and no capabilities left. Standard library only (the sandbox
imports nothing of the worker); the sandbox loads it with its siblings (child.py), before
any layer is in place, and layers.py puts these layers in their order.

Each layer holds without the audit hook: the hook is Python code in the same interpreter as
the model's code, and code can get past it; the kernel cannot be argued with.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import platform
import select
import signal
import struct
import sys
import sysconfig
from collections.abc import Iterable
from typing import Any

# clone/unshare flags
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACE_FLAGS = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)

# mount flags
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2

ROOT_DIR = ".drlm-root"
"""The empty directory in the sandbox's own directory where its root filesystem is built (a
tmpfs); after the pivot it is an empty directory again, and is removed."""

HOST_FILES = "/.drlm-host"
"""Where, in the private root, the host's side of the sandbox directory is seen read-only:
the files the host writes for the sandbox (the context, a snapshot to restore), which the
sandbox's own directory, a tmpfs, no longer shows."""

TMP_SIZE = "size=64m,mode=1777"
SHM_SIZE = "size=16m,mode=1777"
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
CONTEXT_FILES = ("context.txt", "context.json")
OWN_TMPFS = "own directory a tmpfs"
"""Said in the filesystem layer's report when the own directory is a tmpfs: the host then
reads the sandbox's files through /proc/PID/root (activities/live_sandbox.py)."""


class KernelLayerError(OSError):
    """A kernel call of a layer failed: the layer is not in place."""


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise KernelLayerError(code, f"{what}: {os.strerror(code)}")


def readonly_sources() -> list[str]:
    """What the sandbox may read: the Python installation (its standard library and the
    installed packages) and the system's shared libraries, time zones and locales. Not the
    worker's source, its data directory, /proc, /etc, /home or any other sandbox."""
    paths = sysconfig.get_paths()
    sources = {
        sys.base_prefix,
        paths.get("stdlib", ""),
        paths.get("platstdlib", ""),
        paths.get("purelib", ""),
        paths.get("platlib", ""),
        "/usr/lib",
        "/usr/lib64",
        "/lib",
        "/lib64",
        "/usr/share/zoneinfo",
        "/etc/localtime",
    }
    chosen: list[str] = []
    for source in sorted({os.path.normpath(s) for s in sources if s}):
        if not os.path.lexists(source):
            continue
        if any(source.startswith(c + os.sep) for c in chosen):
            continue  # inside one already bound
        chosen.append(source)
    return chosen


class Mounts:
    def __init__(self, libc: Any) -> None:
        self.libc = libc
        self.libc.mount.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_char_p,
        ]
        self.libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def mount(
        self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None
    ) -> None:
        _check(
            self.libc.mount(
                source.encode() if source else None,
                target.encode(),
                fstype.encode() if fstype else None,
                flags,
                data.encode() if data else None,
            ),
            f"mount {source or fstype} on {target}",
        )

    def bind(self, source: str, target: str, writable: bool, device: bool = False) -> None:
        """Bind `source` at `target`, read-only unless `writable`; never setuid, never a
        device unless it is one of DEVICES. Flags the source's mount locks are kept."""
        self.mount(source, target, None, MS_BIND | MS_REC, None)
        locked = os.statvfs(source).f_flag & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        flags = MS_BIND | MS_REMOUNT | MS_NOSUID | locked
        if not device:
            flags |= MS_NODEV
        if not writable:
            flags |= MS_RDONLY
        self.mount(None, target, None, flags, None)


def _make_target(root: str, path: str, is_dir: bool) -> str:
    target = root + path
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            with open(target, "wb"):
                pass
    return target


def isolate_filesystem(
    libc: Any, sandbox_dir: str, sources: Iterable[str], dir_mb: int | None = None, uid: int | None = None
) -> str:
    """Enter a private mount namespace whose root holds only `sources` (read-only), the
    sandbox's own directory (read-write, at its own path), four devices, and a private /tmp
    and /dev/shm. Needs CAP_SYS_ADMIN (root, or a user namespace of our own).

    With `dir_mb`, the own directory is a tmpfs of that size (owned by `uid`, when given)
    instead of the host's directory: what cells write is bounded there, and its pages count
    against the sandbox's memory cgroup, never the host's disk. The host's directory is then
    seen read-only at HOST_FILES (and its context file in the own directory, read-only); the
    host reads what the sandbox writes through the sandbox's own view, /proc/PID/root."""
    mounts = Mounts(libc)
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mounts.mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing leaks back to the host
    root = os.path.join(sandbox_dir, ROOT_DIR)
    os.makedirs(root, exist_ok=True)
    mounts.mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    unreachable = []
    for source in sources:
        if not os.access(source, os.R_OK):
            unreachable.append(source)  # this uid could not read it anyway (under /root, say)
            continue
        if os.path.islink(source):  # /lib -> usr/lib on a merged /usr: the same link
            _make_target(root, os.path.dirname(source), True)
            os.symlink(os.readlink(source), root + source)
            continue
        is_dir = os.path.isdir(source)
        mounts.bind(source, _make_target(root, source, is_dir), writable=False)
    for device in DEVICES:
        if os.path.exists(device):
            mounts.bind(device, _make_target(root, device, False), writable=True, device=True)
    mounts.mount("tmpfs", _make_target(root, "/tmp", True), "tmpfs", MS_NOSUID | MS_NODEV, TMP_SIZE)
    mounts.mount("tmpfs", _make_target(root, "/dev/shm", True), "tmpfs", MS_NOSUID | MS_NODEV, SHM_SIZE)
    # The sandbox's own directory last, so a source above it cannot cover it.
    own = _make_target(root, sandbox_dir, True)
    if dir_mb is None:
        mounts.mount(sandbox_dir, own, None, MS_BIND, None)
        mounts.mount(None, own, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV, None)
    else:
        mounts.bind(sandbox_dir, _make_target(root, HOST_FILES, True), writable=False)
        owner = "" if uid is None else f",uid={uid},gid={uid}"
        mounts.mount("tmpfs", own, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(dir_mb)}m,mode=0700{owner}")
        for name in CONTEXT_FILES:  # where cells have always found it, read-only
            source = os.path.join(sandbox_dir, name)
            if os.path.isfile(source):
                mounts.bind(source, _make_target(own, "/" + name, False), writable=False)
    old = os.path.join(root, ".old")
    os.mkdir(old)
    libc.syscall.restype = ctypes.c_long
    _check(libc.syscall(_PIVOT_ROOT, root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount the old root")
    os.rmdir("/.old")
    mounts.mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    os.chdir(sandbox_dir)
    try:
        os.rmdir(ROOT_DIR)  # the mountpoint the root was built on: empty again
    except OSError:
        pass
    shown = "private root: Python and system libraries read-only, own directory, private /tmp"
    if dir_mb is not None:
        shown += f"; {OWN_TMPFS} of {int(dir_mb)} MB"
    return shown + (f" (unreadable, left out: {', '.join(unreachable)})" if unreachable else "")


def enter_user_namespace(libc: Any, uid: int, gid: int) -> None:
    """A user namespace of our own, `uid`/`gid` mapped to themselves: the process keeps its
    (unprivileged) ids and gains capabilities over namespaces it then creates only."""
    pr_set_dumpable = 4
    _check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    # A uid change cleared "dumpable", which leaves /proc/self's files to root: the maps
    # could not be written. Set for the writes only.
    _check(libc.prctl(pr_set_dumpable, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    try:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    finally:
        libc.prctl(pr_set_dumpable, 0, 0, 0, 0)


def drop_capabilities(libc: Any) -> None:
    """Every capability gone, in every set, the bounding set included."""
    pr_capbset_drop = 24
    for cap in range(64):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability this kernel knows
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = b"\0" * 24  # two cap_user_data_t of three u32 each: effective, permitted, inheritable
    libc.syscall.restype = ctypes.c_long
    _check(libc.syscall(_CAPSET, header, data), "capset")
    ambient_clear_all = (47, 4)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    libc.prctl(ambient_clear_all[0], ambient_clear_all[1], 0, 0, 0)


# --- IPC and PID namespaces ------------------------------------------------------------------

SANDBOX_NAMESPACES = CLONE_NEWIPC | CLONE_NEWPID


def private_ipc_and_pids(libc: Any) -> str:
    """An IPC namespace of its own (System V message queues, semaphores and shared memory,
    and POSIX message queues: no other sandbox can open them by key, and the kernel frees
    them all when the sandbox's last process exits), and a PID namespace for the processes
    it starts next (`become_pid_one`). Needs CAP_SYS_ADMIN (root, or a user namespace of
    our own)."""
    _check(libc.unshare(SANDBOX_NAMESPACES), "unshare(CLONE_NEWIPC | CLONE_NEWPID)")
    return "ipc+pid" if SANDBOX_NAMESPACES & CLONE_NEWPID else "ipc"


def become_pid_one(libc: Any, host_reads: bool = False) -> None:
    """Fork into the PID namespace `private_ipc_and_pids` made: the child returns, as its
    PID 1, and runs the REPL; this process stays outside, waits for it and exits as it did.

    So the REPL sees no process but its own and those it starts (it can signal, trace or
    name nothing else, whatever its uid), and when it dies the kernel kills every process
    left in the namespace: nothing a cell started outlives its sandbox. The host keeps this
    process's pid: the parent it knows, its process group (which the REPL shares), its exit
    code. Killing this process kills the REPL (its parent-death signal), hence the whole
    namespace.

    `host_reads`: the keeper lets its host (a worker of its own uid, not root) read the
    sandbox's files through /proc/PID/root (its tmpfs shows nowhere else): a process whose uid
    changed, or that entered a user namespace, is not "dumpable", and /proc leaves it to
    root. Only processes of that uid outside the sandbox can name the keeper; the REPL, in
    its own PID namespace, cannot."""
    alive_r, alive_w = os.pipe()  # the REPL sees EOF on it once its keeper is gone
    pid = os.fork()
    if pid != 0:
        os.close(alive_r)
        if host_reads:
            libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE, this process only (the REPL stays not)
        _keep(pid, alive_w)
    os.close(alive_w)
    _check(libc.prctl(1, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")  # SIGKILL; a fork cleared it
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(3)  # the keeper died before the death signal was set: so does the sandbox
    os.close(alive_r)


def _keep(pid: int, alive_w: int) -> Any:
    """The keeper's whole life: hold nothing of the sandbox's (its channel is closed here),
    wait for the REPL, end the same way. It never returns."""
    gc.disable()  # touches no page it shares with the REPL
    for fd in range(3, 1024):
        if fd != alive_w:
            try:
                os.close(fd)
            except OSError:
                pass
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(4)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            if number not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
        except (OSError, ValueError):
            pass
        os._exit(128 + number)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 4)


# --- seccomp ---------------------------------------------------------------------------------

_X86_64 = platform.machine() == "x86_64"
_PIVOT_ROOT, _CAPSET = (155, 126) if _X86_64 else (41, 91)  # x86_64, else aarch64
AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000

# What the REPL never needs, by x86_64 number: other processes' memory and tracing, mounts and
# namespaces, the kernel's keyring, modules and BPF, leaving the process group (the host kills
# the group on close), and handles that step around paths.
DENIED_X86_64 = {
    "ptrace": 101,
    "setpgid": 109,
    "setsid": 112,
    "personality": 135,
    "pivot_root": 155,
    "chroot": 161,
    "acct": 163,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "pidfd_getfd": 438,
    "mount_setattr": 442,
    # A kernel attack surface of its own, and I/O that steps around seccomp (io_uring's
    # operations are not system calls a filter sees); anonymous memory files a REPL never
    # needs (a way to stage executable code without touching the filesystem).
    "memfd_create": 319,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "memfd_secret": 447,
}
_CLONE, _CLONE3, _SOCKET, _SOCKETPAIR = 56, 435, 41, 53

AF_NETLINK, AF_PACKET, AF_VSOCK = 16, 17, 40
DENIED_SOCKET_FAMILIES = {"AF_NETLINK": AF_NETLINK, "AF_PACKET": AF_PACKET, "AF_VSOCK": AF_VSOCK}
"""Socket families a REPL never needs, refused by `socket` (and `socketpair`) whatever the
network namespace: the kernel's routing and audit interfaces, raw frames, and the channel to
a hypervisor. They fail with EAFNOSUPPORT, as on a kernel built without them."""

# BPF
_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_program() -> bytes:
    """The filter: x86_64 only (another architecture or the x32 ABI kills the process), every
    DENIED call fails with EPERM, socket and socketpair of a DENIED_SOCKET_FAMILIES family
    with EAFNOSUPPORT, clone with a namespace flag with EPERM, and clone3 with ENOSYS (its
    flags are out of reach of a filter; the C library then uses clone)."""
    eperm, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    eafnosupport = _RET_ERRNO | errno.EAFNOSUPPORT
    denied = sorted(DENIED_X86_64.values())
    body = [_insn(_LD_W_ABS, 0, 0, _OFF_NR)]
    for number in denied:
        body.append(_insn(_JEQ_K, 0, 1, number))
        body.append(_insn(_RET_K, 0, 0, eperm))
    families = sorted(DENIED_SOCKET_FAMILIES.values())
    # socket/socketpair: load the family (the low 32 bits of the first argument), refuse the
    # denied ones, allow the rest; anything else jumps past this block with nr still loaded.
    check = [_insn(_LD_W_ABS, 0, 0, _OFF_ARG0)]
    for i, family in enumerate(families):
        check.append(_insn(_JEQ_K, len(families) - i, 0, family))  # to the refusal
    check += [_insn(_RET_K, 0, 0, _RET_ALLOW), _insn(_RET_K, 0, 0, eafnosupport)]
    body += [
        _insn(_JEQ_K, 1, 0, _SOCKET),
        _insn(_JEQ_K, 0, len(check), _SOCKETPAIR),
        *check,
        _insn(_JEQ_K, 0, 1, _CLONE3),
        _insn(_RET_K, 0, 0, enosys),
        _insn(_JEQ_K, 0, 3, _CLONE),
        _insn(_LD_W_ABS, 0, 0, _OFF_ARG0),  # the low 32 bits of clone's flags
        _insn(_JSET_K, 0, 1, NAMESPACE_FLAGS),
        _insn(_RET_K, 0, 0, eperm),
        _insn(_RET_K, 0, 0, _RET_ALLOW),
    ]
    head = [
        _insn(_LD_W_ABS, 0, 0, _OFF_ARCH),
        _insn(_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
        _insn(_JSET_K, 0, 1, X32_BIT),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
    ]
    return b"".join(head + body)


def install_seccomp(libc: Any) -> str:
    if not _X86_64:
        return f"off (no filter for {platform.machine()})"
    program = seccomp_program()
    count = len(program) // 8
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("=H6xQ", count, ctypes.addressof(buffer))
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    _check(libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    fprog_buffer = ctypes.create_string_buffer(fprog)
    address = ctypes.c_void_p(ctypes.addressof(fprog_buffer))  # a pointer, not a C int
    _check(libc.prctl(pr_set_seccomp, seccomp_mode_filter, address, 0, 0), "prctl(PR_SET_SECCOMP)")
    families = "/".join(sorted(DENIED_SOCKET_FAMILIES))
    return f"{len(DENIED_X86_64)} calls refused, {families} sockets refused, namespaces in clone refused"
