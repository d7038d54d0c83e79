"""Ends a rank within seconds, naming the rank, when another rank's process dies during a job.

Trap: gloo does not wake a send that is being written when its peer dies. tcp::Pair::signalException fails the
pair's queued operations, not the one under way, so a rank whose last wait is such a send (a broadcast from it,
the end of an all-gather) waits out the whole --collective_timeout_s. tests/test_peer_watch.py shows it: a
broadcast from rank 0 whose receiver is killed.

So each rank keeps one plain TCP connection to rank 0 besides the backend's. The kernel closes the connections
of a process that dies, however it dies: rank 0 sees the death at once and tells the others. A rank that
leaves cleanly says BYE first; a connection that closes without it is a death. On a death a rank waits GRACE_S
first, because its own main thread may be leaving already with an error line of its own (every rank meets a
failed checkpoint at once, say), which names the cause better. A frozen process keeps its connections open:
that case is still the collective timeout's.
"""

import selectors
import socket
import struct
import threading
from collections.abc import Callable

BYE = b"B"
GONE = b"G"  # from rank 0, followed by the rank it lost (4 bytes, network order)
RANK = struct.Struct("!i")
GRACE_S = 5.0


class PeerWatch:
    """rank 0 holds a connection to every other rank; the others one connection, to rank 0. on_death(text) is
    called from the watching thread with the reason (it is expected not to return: the job is over)."""

    def __init__(self, rank: int, hosts: list, connections: dict, on_death: Callable[[str], None]):
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
        selector, pending = selectors.DefaultSelector(), {peer: b"" for peer in self.connections}
        for peer, connection in self.connections.items():
            selector.register(connection, selectors.EVENT_READ, peer)
        while pending and not self.leaving.is_set():
            for key, _ in selector.select(timeout=1.0):
                peer = key.data
                try:
                    received = key.fileobj.recv(64)
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

    def _read_messages(self, peer: int, pending: dict) -> bool:
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

    def _lost(self, what: str, peer) -> None:
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


def start(rank: int, world: int, hosts: list, master_addr: str, share_port: Callable[[int], int],
          timeout_s: float, on_death: Callable[[str], None]) -> PeerWatch | None:
    """Connect every rank to rank 0 and start watching; None for a world of one. Collective: share_port(port)
    gives every rank rank 0's listening port (rank 0 passes it, the others anything)."""
    if world == 1:
        return None
    if rank == 0:
        with socket.create_server(("", 0)) as listener:
            share_port(listener.getsockname()[1])
            listener.settimeout(timeout_s)
            connections = {}
            while len(connections) < world - 1:
                connection, _ = listener.accept()
                connection.settimeout(timeout_s)
                peer = RANK.unpack(_receive_exactly(connection, RANK.size))[0]
                connection.settimeout(None)
                connections[peer] = connection
    else:
        port = share_port(0)
        connection = socket.create_connection((master_addr, port), timeout=timeout_s)
        connection.sendall(RANK.pack(rank))
        connection.settimeout(None)
        connections = {0: connection}
    return PeerWatch(rank, hosts, connections, on_death)


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("a rank closed its peer-watch connection while joining")
        data += chunk
    return data
