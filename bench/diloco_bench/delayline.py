"""The WAN emulation's delay line (see netns.py): reads IPv4 packets from a TUN device in the hub namespace, holds each
for delay(source) + delay(destination) ± jitter, and writes it back, keeping the order of every (source, destination)
pair (jitter without reordering, as a real path). Run by `netns.Network`:

    python -m diloco_bench.delayline --tun dlw0 10.213.1.2=20,5 10.213.2.2=20,5 ...   (ADDRESS=DELAY_MS,JITTER_MS)

Prints "ready" once the device exists; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


class Schedule:
    """When each packet leaves: pure, so the timing rules are testable without a device."""

    def __init__(self, delays: dict[bytes, tuple[float, float]], rng: random.Random | None = None):
        self.delays = delays  # 4-byte IPv4 address -> (one-way delay s, jitter s) of its link
        self.rng = rng or random.Random(0)
        self.last: dict[tuple[bytes, bytes], float] = {}

    def one_way(self, address: bytes) -> float:
        delay, jitter = self.delays.get(address, (0.0, 0.0))
        return max(0.0, delay + (self.rng.uniform(-jitter, jitter) if jitter else 0.0))

    def release(self, packet: bytes, now: float) -> float | None:
        """The time `packet` may leave, or None for what is not IPv4 (dropped)."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return None
        src, dst = packet[12:16], packet[16:20]
        t = max(now + self.one_way(src) + self.one_way(dst), self.last.get((src, dst), 0.0))
        self.last[(src, dst)] = t
        return t


def parse_links(items: list[str]) -> dict[bytes, tuple[float, float]]:
    """ADDRESS=DELAY_MS,JITTER_MS items as {address bytes: (delay s, jitter s)}."""
    import ipaddress

    out = {}
    for item in items:
        addr, _, spec = item.partition("=")
        delay, _, jitter = spec.partition(",")
        out[ipaddress.IPv4Address(addr).packed] = (float(delay) / 1000.0, float(jitter or 0) / 1000.0)
    return out


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def serve(fd: int, schedule: Schedule) -> None:
    """Forward packets until SIGTERM: read what is there, write what is due, sleep until the next is due."""
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))
    due: list[tuple[float, int, bytes]] = []
    seq = 0
    while not stop["flag"]:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, packet = heapq.heappop(due)
            try:
                os.write(fd, packet)
            except BlockingIOError:
                pass  # the kernel's queue is full: a drop, as a router would
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else 0.5
        try:
            ready, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        if not ready:
            continue
        now = time.monotonic()
        while True:
            try:
                packet = os.read(fd, 65536)
            except BlockingIOError:
                break
            t = schedule.release(packet, now)
            if t is not None:
                heapq.heappush(due, (t, seq, packet))  # seq: equal times leave in arrival order
                seq += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco_bench.delayline")
    parser.add_argument("--tun", required=True)
    parser.add_argument("links", nargs="+", metavar="ADDRESS=DELAY_MS,JITTER_MS")
    args = parser.parse_args(argv)
    schedule = Schedule(parse_links(args.links), random.Random(int.from_bytes(os.urandom(4), "big")))
    fd = open_tun(args.tun)
    print("ready", flush=True)
    serve(fd, schedule)
    return 0


if __name__ == "__main__":
    sys.exit(main())
