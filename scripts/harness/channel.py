"""A coordinator and its worker processes talking over one AF_UNIX socket (which works across network namespaces).

Coordinator::

    hub = Hub(workdir / "hub.sock")                     # a random authentication key
    runner.start(name, argv, env=hub.worker_env())      # the worker finds the key in its environment
    role, index, msg = hub.get(timeout=1.0)             # a worker's message; None on timeout
    hub.send("publisher", 0, ("publish", True))

Worker::

    conn, send = connect(socket_path, "publisher", 0)   # says hello; forwards pulseloco's warnings
    send(("ready", {...})); msg = conn.recv()

Messages are picklable tuples whose first item names them. The hub reports a worker's own hello, every message,
then ``("eof",)`` when its connection ends; a worker's pulseloco warnings arrive as ``("warning", text)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

AUTHKEY_ENV = "HARNESS_CHANNEL_AUTHKEY"
"""The environment variable that hands the hub's authentication key (hex) to the workers."""

Message = tuple[str, int, tuple]
"""(worker role, worker index, the worker's message)."""


class Hub:
    """The coordinator's end: a listener on ``path`` and one reader thread per worker, feeding one queue.

    Raises OSError when the socket cannot be made (an AF_UNIX path is limited to about 100 bytes).
    """

    def __init__(self, path: str | Path, authkey: bytes | None = None) -> None:
        self.path = str(path)
        self.authkey = authkey if authkey is not None else os.urandom(16)
        self.listener = Listener(self.path, family="AF_UNIX", authkey=self.authkey)
        self.messages: queue.Queue[Message] = queue.Queue()
        self.conns: dict[tuple[str, int], Connection] = {}
        self._lock = threading.Lock()
        self._generation = 0
        """Incremented by :meth:`forget`: what a connection of an earlier generation still says is dropped."""
        self.closed = False
        threading.Thread(target=self._accept, name="hub-accept", daemon=True).start()

    def worker_env(self) -> dict[str, str]:
        """What a worker's environment needs for :func:`connect`."""
        return {AUTHKEY_ENV: self.authkey.hex()}

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn = self.listener.accept()
            except Exception:  # closed, or a client that failed authentication
                continue
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: Connection) -> None:
        try:
            hello = conn.recv()
        except (EOFError, OSError):
            return
        if not (isinstance(hello, tuple) and hello[0] == "hello"):
            return
        who = (hello[1], int(hello[2]))
        with self._lock:
            generation = self._generation
            self.conns[who] = conn
        self._put(generation, who, hello)
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self._put(generation, who, ("eof",))
                return
            self._put(generation, who, msg)

    def _put(self, generation: int, who: tuple[str, int], msg: tuple) -> None:
        """Queue ``msg`` unless :meth:`forget` was called since its connection said hello (a finished case's worker
        whose end of the connection closes late, with its last process: its ``eof`` is not the next case's)."""
        with self._lock:
            if generation == self._generation:
                self.messages.put((who[0], who[1], msg))

    def get(self, timeout: float) -> Message | None:
        """The next message from any worker, None after ``timeout`` seconds without one."""
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def send(self, role: str, index: int, msg: tuple) -> None:
        """Send ``msg`` to a worker that said hello; raises KeyError for an unknown one, OSError when its
        connection is gone."""
        with self._lock:
            conn = self.conns[(role, index)]
        conn.send(msg)

    def forget(self) -> None:
        """Drop the workers' connections, every message not read yet and every later one from them (their
        processes ended)."""
        with self._lock:
            self._generation += 1
            self.conns.clear()
        while True:
            try:
                self.messages.get_nowait()
            except queue.Empty:
                break

    def close(self) -> None:
        """Stop accepting workers (idempotent; never raises)."""
        self.closed = True
        with contextlib.suppress(Exception):
            self.listener.close()


class _ForwardWarnings(logging.Handler):
    """Sends pulseloco's warnings to the coordinator (the first 500 characters of each)."""

    def __init__(self, send: Callable[[tuple], None]) -> None:
        super().__init__(level=logging.WARNING)
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self._send(("warning", f"{record.name}: {record.getMessage()}"[:500]))


def connect(socket_path: str, role: str, index: int) -> tuple[Connection, Callable[[tuple], None]]:
    """A worker's connection to the hub at ``socket_path`` (the key from its environment), after saying hello;
    returns it and a thread-safe ``send``. pulseloco's warnings go to the hub from then on. Raises KeyError
    without the key in the environment, OSError or AuthenticationError when the hub cannot be reached."""
    conn = Client(socket_path, family="AF_UNIX", authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:
            conn.send(msg)

    send(("hello", role, index, os.getpid()))
    logging.getLogger("pulseloco").addHandler(_ForwardWarnings(send))
    return conn, send
