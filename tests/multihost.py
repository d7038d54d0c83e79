"""Test hosts on this machine: network namespaces joined by a bridge, each running its own sshd.

Each host is a network namespace with one interface, `eth0`, at 10.200.0.<i>/24 (the same interface name
everywhere, so one GLOO_SOCKET_IFNAME fits every host, as on a real cluster). The interfaces are veth
pairs whose other ends sit on a bridge inside a further "switch" namespace: nothing is added to the
machine's own network. Every host runs an sshd started by hand: its own config, host key and port,
root login with a key only. The hosts share the file system, the process table and the host name with
the machine, so hostfiles name them by address and a checkpoint directory is shared as on a cluster
with a shared file system.

The client side never touches the machine's ssh setup (~/.ssh, /etc/ssh): `bin/ssh` in the harness
directory runs the real /usr/bin/ssh with `-F <harness>/ssh_config` (port, key, known_hosts of the test
hosts). Putting that directory first on PATH stands in for a user's ~/.ssh/config for everything that
calls `ssh`: DeepSpeed's reachability check, pdsh's ssh module, the preflight.

Teardown ends every process that runs inside the namespaces (by pid: `ip netns pids`) and deletes the
namespaces; it runs even when setup or a test fails, and after SIGTERM (tests/conftest.py).
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.200.0"
SSH_PORT = 2222
INTERFACE = "eth0"
TOOLS = ("ip", "sshd", "ssh", "ssh-keygen", "pdsh")
SSHD_CONFIG = """\
Port {port}
ListenAddress {address}
HostKey {host_key}
PidFile none
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
LogLevel ERROR
"""
SSH_CONFIG = """\
Host {subnet}.*
    Port {port}
    User root
    IdentityFile {client_key}
    IdentitiesOnly yes
    UserKnownHostsFile {known_hosts}
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 5
    ServerAliveInterval 5
    ServerAliveCountMax 3
"""


def unavailable_reason():
    """Why this machine cannot make test hosts (None when it can)."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces and sshd); run .ci/run as root"
    missing = [tool for tool in TOOLS if not find_tool(tool)]
    if missing:
        return (f"multi-host tests need {', '.join(missing)} (Debian: apt-get install iproute2 "
                "openssh-server openssh-client pdsh; .ci/run installs them as root)")
    probe = f"hlprobe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot create a network namespace here: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def find_tool(name):
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def run(command, **kwargs):
    """Run a setup command; its failure is an error naming the command and what it printed."""
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def remove_leftovers():
    """Delete the empty namespaces of earlier test sessions whose process is gone (a session killed
    before its teardown, e.g. by SIGKILL, leaves them behind)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listing.splitlines() if line.strip()):
        match = re.fullmatch(r"hl(\d+)[a-z]?(?:h\d+|sw)", name)
        if match and not Path(f"/proc/{match.group(1)}").exists() and not TestHosts.pids(name):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


class TestHosts:
    """`count` hosts 10.200.0.1..count; use as a context manager (teardown on exit). `tag`, one lowercase letter,
    sets a second set of hosts apart from the untagged one in the same session (both have the same addresses, each
    on its own bridge): its own namespaces and master port."""

    __test__ = False  # not a pytest test class

    def __init__(self, directory, count=3, tag=""):
        if not re.fullmatch(r"[a-z]?", tag):
            raise ValueError(f"tag must be one lowercase letter or empty, not {tag!r}")
        self.directory = Path(directory)
        self.count = count
        self.prefix = f"hl{os.getpid()}{tag}"  # unique per test session: two sessions never share namespaces
        # The hosts share the machine's process table, and scripts/signal_ranks.sh finds a job's ranks by the
        # master address and port of their launcher: with one port for every session, the SIGTERM test of one
        # pytest-xdist worker and the supervisor's KILL of leftover ranks in another hit each other's jobs.
        # Untagged hosts take 20000-39999, tagged ones 40000-59999.
        self.master_port = (40000 if tag else 20000) + os.getpid() % 20000
        self.switch = f"{self.prefix}sw"
        self.namespaces = [f"{self.prefix}h{i + 1}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.sshd = []
        self.created = []

    # ---------------------------------------------------------------- setup and teardown
    def __enter__(self):
        remove_leftovers()
        try:
            self._make_network()
            self._make_keys()
            for namespace, address in zip(self.namespaces, self.addresses):
                self._start_sshd(namespace, address)
            for address in self.addresses:
                self._wait_for_ssh(address)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _make_network(self):
        run(["ip", "netns", "add", self.switch])
        self.created.append(self.switch)
        run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
            run(["ip", "netns", "add", namespace])
            self.created.append(namespace)
            port = f"port{i + 1}"
            run(["ip", "-n", namespace, "link", "add", INTERFACE, "type", "veth", "peer", "name", port,
                 "netns", self.switch])
            run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
            run(["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", INTERFACE])
            run(["ip", "-n", namespace, "link", "set", INTERFACE, "up"])
            run(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def _make_keys(self):
        self.directory.mkdir(parents=True, exist_ok=True)
        keygen = find_tool("ssh-keygen")
        client_key = self.directory / "client_key"
        run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", "hl-test-client", "-f", str(client_key)])
        shutil.copy(f"{client_key}.pub", self.directory / "authorized_keys")
        known_hosts = []
        for namespace, address in zip(self.namespaces, self.addresses):
            host_key = self.directory / f"host_key_{namespace}"
            run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", address, "-f", str(host_key)])
            key_type, key = Path(f"{host_key}.pub").read_text().split()[:2]
            known_hosts.append(f"[{address}]:{SSH_PORT} {key_type} {key}\n")
        (self.directory / "known_hosts").write_text("".join(known_hosts))
        (self.directory / "ssh_config").write_text(SSH_CONFIG.format(
            subnet=SUBNET, port=SSH_PORT, client_key=client_key, known_hosts=self.directory / "known_hosts"))
        bin_dir = self.directory / "bin"
        bin_dir.mkdir(exist_ok=True)
        wrapper = bin_dir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {find_tool("ssh")} -F "{self.directory / "ssh_config"}" "$@"\n')
        wrapper.chmod(0o755)

    def _start_sshd(self, namespace, address):
        config = self.directory / f"sshd_config_{namespace}"
        config.write_text(SSHD_CONFIG.format(port=SSH_PORT, address=address,
                                             host_key=self.directory / f"host_key_{namespace}",
                                             authorized_keys=self.directory / "authorized_keys"))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        log = open(self.directory / f"sshd_{namespace}.log", "w")
        process = subprocess.Popen(["ip", "netns", "exec", namespace, find_tool("sshd"), "-D", "-e", "-f", str(config)],
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.sshd.append(process)

    def _wait_for_ssh(self, address, timeout=20):
        deadline = time.monotonic() + timeout
        while True:
            result = subprocess.run(self.command_on(0, ["ssh", address, "true"]), env=self.env(), capture_output=True,
                                    text=True)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                logs = " | ".join(p.read_text().strip() for p in self.directory.glob("sshd_*.log"))
                raise RuntimeError(f"ssh to {address} failed: {result.stderr.strip()} (sshd: {logs})")
            time.sleep(0.2)

    def close(self):
        """End every process inside the namespaces (by pid), then delete the namespaces."""
        for namespace in reversed(self.created):
            for attempt in (signal.SIGTERM, signal.SIGKILL):
                pids = self.pids(namespace)
                for pid in pids:
                    try:
                        os.kill(pid, attempt)
                    except ProcessLookupError:
                        pass
                if not self._wait_gone(namespace, 5):
                    continue
                break
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        for process in self.sshd:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
        self.created.clear()

    def _wait_gone(self, namespace, timeout):
        deadline = time.monotonic() + timeout
        while self.pids(namespace):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    # ---------------------------------------------------------------- use
    @staticmethod
    def pids(namespace):
        result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        return [int(pid) for pid in result.stdout.split()]

    def env(self, base=None):
        """An environment in which `ssh` (and so pdsh with PDSH_RCMD_TYPE=ssh) reaches the test hosts."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.directory / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["PDSH_RCMD_TYPE"] = "ssh"
        return env

    def hostfile(self, path, hosts=2, slots=1):
        """A DeepSpeed hostfile naming the first `hosts` hosts by address."""
        Path(path).write_text("".join(f"{address} slots={slots}\n" for address in self.addresses[:hosts]))
        return Path(path)

    def command_on(self, host, command):
        """`command` (a list) run inside host `host` (0-based), as a process on that host would be."""
        return ["ip", "netns", "exec", self.namespaces[host], *map(str, command)]

    def lose(self, host):
        """Host `host` (0-based) is lost, as a server that powers off: every process inside it, its sshd and
        the job's ranks included, is killed at once."""
        for pid in self.pids(self.namespaces[host]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def restart_sshd(self, host):
        """Host `host` back up: its sshd started again, and answering."""
        self._start_sshd(self.namespaces[host], self.addresses[host])
        self._wait_for_ssh(self.addresses[host])

    @contextlib.contextmanager
    def without(self, host, directory):
        """`directory` hidden on host `host` (0-based), as on a server whose disk lacks it: an empty tmpfs
        mounted over it in the mount namespace of that host's sshd, which every ssh session there inherits
        (`ip netns exec` gave it its own); this machine and the other hosts still see it."""
        sshd = next(p for p in reversed(self.sshd) if p.args[3] == self.namespaces[host] and p.poll() is None)
        run(["nsenter", "-t", str(sshd.pid), "-m", "mount", "-t", "tmpfs", "tmpfs", str(directory)])
        try:
            yield
        finally:
            run(["nsenter", "-t", str(sshd.pid), "-m", "umount", str(directory)])

    def set_link(self, host, up):
        """Host `host`'s network interface up or down, inside its namespace. Up returns once the first host (0)
        reaches it by ssh: test_supervisor.py's by-hand run, started at once after the link came back, once failed its
        preflight with "ssh: connect to host 10.200.0.3 port 2222: No route to host"."""
        run(["ip", "-n", self.namespaces[host], "link", "set", INTERFACE, "up" if up else "down"])
        if up:
            self._wait_for_ssh(self.addresses[host])

    def rank_pids(self, host, script="run_pretraining.py"):
        """Pids of processes inside host `host` whose command line runs `script` directly (the ranks, not
        DeepSpeed's per-node launcher, whose command line also names the script)."""
        ranks = []
        for pid in self.pids(self.namespaces[host]):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            names = [Path(a.decode()).name for a in argv[:3]]
            if script in names and "deepspeed.launcher.launch" not in (a.decode() for a in argv):
                ranks.append(pid)
        return ranks
