"""Ends a rank within seconds, naming the rank, when another rank's process dies during a job.

Trap: gloo does not wake a send that is being written when its peer dies. tcp::Pair::signalException fails the
pair's queued operations, not the one under way, so a rank whose last wait is such a send (a broadcast from it,
the end of an all-gather) waits out the whole --collective_timeout_s. tests/test_peer_watch.py shows it: a
broadcast from rank 0 whose receiver is killed.

So each rank keeps one plain TCP connection to rank 0 besides the backend's. The kernel closes the connections
of a process that dies (killed, crashed, out of memory): rank 0 sees the death at once and tells the others.
A rank that leaves cleanly says BYE first; a connection that closes without it is a death. On a death a rank
waits GRACE_S first, because its own main thread may be leaving already with an error line of its own (every
rank meets a failed checkpoint at once, say), which names the cause better; the others wait as long again
after rank 0's word. A frozen process keeps its connections open, and a server that loses its power or its
network closes none: those cases are still the collective timeout's.
"""

import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from common.errors import HostInputError

BYE = b"B"
GONE = b"G"  # from rank 0, followed by the rank it lost (4 bytes, network order)
RANK = struct.Struct("!i")
GRACE_S = 5.0
JOIN_TIMEOUT_S = 60.0  # the ranks set out to join together, just after a collective


class PeerWatch:
    """rank 0 holds a connection to every other rank; the others one connection, to rank 0. on_death(text) is
    called from the watching thread with the reason; it ends the process, unless the process is leaving already."""

    def __init__(self, rank: int, hosts: list[str], connections: dict[int, socket.socket],
                 on_death: Callable[[str], None]) -> None:
        self.rank, self.hosts, self.connections, self.on_death = rank, hosts, connections, on_death
        self.leaving = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="peer watch", daemon=True)
        self.thread.start()

    def leave(self, goodbye: bool) -> None:
        """Stop watching. goodbye: this rank ends cleanly, so tell the others; without it they see a death."""
        self.leaving.set()
        for connection in self.connections.values():
            try:
                if goodbye:
                    connection.sendall(BYE)
                connection.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _watch(self) -> None:
        selector = selectors.DefaultSelector()
        pending = {peer: b"" for peer in self.connections}  # what each peer sent, not yet read as a message
        for peer, connection in self.connections.items():
            selector.register(connection, selectors.EVENT_READ, peer)
        while pending and not self.leaving.is_set():
            for key, _ in selector.select(timeout=1.0):
                peer = key.data
                try:
                    received = self.connections[peer].recv(64)
                except OSError:  # reset by the peer's kernel
                    received = b""
                if received:
                    pending[peer] += received
                    if self._read_messages(peer, pending):
                        selector.unregister(key.fileobj)
                    continue
                selector.unregister(key.fileobj)
                del pending[peer]
                self._lost(f"the connection to rank {peer} on {self.hosts[peer]} broke: that rank died", peer)

    def _read_messages(self, peer: int, pending: dict[int, bytes]) -> bool:
        """Act on what `peer` sent; True when it said goodbye (nothing more to watch there)."""
        data = pending[peer]
        if data.startswith(BYE):
            del pending[peer]
            return True
        if data.startswith(GONE) and len(data) >= 1 + RANK.size:
            lost = RANK.unpack_from(data, 1)[0]
            pending[peer] = data[1 + RANK.size:]
            self._lost(f"rank {lost} on {self.hosts[lost]} died (rank 0 lost its connection to it)", None)
        return False

    def _lost(self, what: str, peer: int | None) -> None:
        if self.leaving.wait(GRACE_S):
            return
        if self.rank == 0 and peer is not None:
            for other, connection in self.connections.items():
                if other != peer:
                    try:
                        connection.sendall(GONE + RANK.pack(peer))
                    except OSError:
                        pass
        self.on_death(f"{what}; the job stops")


def start(rank: int, world: int, hosts: list[str], master_addr: str, share_port: Callable[[int], int],
          timeout_s: float, on_death: Callable[[str], None]) -> PeerWatch | None:
    """Connect every rank to rank 0 and start watching; None for a world of one. Collective: share_port(port)
    gives every rank rank 0's listening port (rank 0 passes it, the others anything). A rank that cannot join
    within JOIN_TIMEOUT_S (at most timeout_s) raises HostInputError: a firewall between the servers, most likely."""
    if world == 1:
        return None
    timeout_s = min(timeout_s, JOIN_TIMEOUT_S)
    if rank == 0:
        connections = _accept_every_rank(world, share_port, timeout_s)
    else:
        port = share_port(0)
        try:
            connection = socket.create_connection((master_addr, port), timeout=timeout_s)
            connection.sendall(RANK.pack(rank))
        except OSError as err:
            raise HostInputError(f"rank {rank} on {hosts[rank]} cannot reach rank 0's peer watch at {master_addr} "
                                 f"port {port}: {err} ({OPEN_PORTS})") from err
        connection.settimeout(None)
        connections = {0: connection}
    return PeerWatch(rank, hosts, connections, on_death)


OPEN_PORTS = "the ranks must reach rank 0 on an ephemeral port besides the backend's ports (docs/several-servers.md)"


def _accept_every_rank(world: int, share_port: Callable[[int], int], timeout_s: float) -> dict[int, socket.socket]:
    """rank 0: a connection from each other rank, by rank. A connection that does not name a rank of the job
    (a port scanner, say) is closed and ignored."""
    if socket.has_dualstack_ipv6():  # MASTER_ADDR may be an IPv6 address
        listener = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=world)
    else:
        listener = socket.create_server(("", 0), backlog=world)
    with listener:
        share_port(listener.getsockname()[1])
        deadline = time.monotonic() + timeout_s
        connections: dict[int, socket.socket] = {}
        while len(connections) < world - 1:
            listener.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                connection, _ = listener.accept()
            except TimeoutError as err:
                missing = sorted(set(range(1, world)) - set(connections))
                raise HostInputError(f"rank 0: rank(s) {', '.join(map(str, missing))} did not join the peer watch "
                                     f"within {timeout_s:g} s ({OPEN_PORTS})") from err
            connection.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                peer = RANK.unpack(_receive_exactly(connection, RANK.size))[0]
            except OSError:
                peer = None
            if peer is None or not 0 < peer < world or peer in connections:
                connection.close()
                continue
            connection.settimeout(None)
            connections[peer] = connection
    return connections


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the connection closed before it named its rank")
        data += chunk
    return data
