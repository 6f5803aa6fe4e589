"""What listens: the TCP listening sockets of a tree of processes, read from /proc (no tool)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int
    process: str  # its program's name and arguments, shortened

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback

    def __str__(self) -> str:
        return f"{self.address}:{self.port} pid {self.pid} ({self.process})"


def descendants(root: int) -> set[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(proc.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, []))
    return tree


def _listening_inodes() -> dict[int, tuple[str, int]]:
    found: dict[int, tuple[str, int]] = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # the kernel prints each 32-bit word of the address in host (little-endian) order
            words = struct.unpack(f"<{len(raw) // 4}I", raw)
            packed = struct.pack(f">{len(words)}I", *words)
            found[int(fields[9])] = (socket.inet_ntop(family, packed), int(hex_port, 16))
    return found


def listeners(pids: set[int]) -> list[Listener]:
    """Every TCP socket in the listening state that one of ``pids`` holds."""
    inodes = _listening_inodes()
    out = []
    for pid in sorted(pids):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[len("socket:[") : -1])
                if inode in inodes:
                    address, port = inodes[inode]
                    # the program's name, not its path: a long install path would push it out
                    command = " ".join([os.path.basename(argv[0]), *argv[1:]]).strip()
                    out.append(Listener(address, port, pid, command[:80]))
    return sorted(set(out), key=lambda x: (x.pid, x.port))
