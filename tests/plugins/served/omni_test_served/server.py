"""``python server.py PORT DIRECTORY``: answer every connection on 127.0.0.1:PORT with DIRECTORY (the standard library only)."""

from __future__ import annotations

import socket
import sys


def ask(address: str, timeout: float = 5.0) -> str:
    """The directory the server at ``host:port`` names."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as conn:
        return conn.makefile("rb").readline().decode().strip()


def main() -> None:
    port, directory = int(sys.argv[1]), sys.argv[2]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        print("ready", flush=True)
        while True:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(directory.encode() + b"\n")


if __name__ == "__main__":
    main()
