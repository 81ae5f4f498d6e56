"""``torchaccrun``: a ``horovodrun``-style launcher for users without MPI (one node).

    torchaccrun -np 2 python train.py --epochs 1
    torchaccrun -np 4 -H localhost:4 python train.py
    python -m torchacc.horovod.run -np 2 python train.py

It starts ``-np`` copies of the command with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: a free port pair for this
job), which ``hvd.init()`` and ``torchacc.distributed`` read. Fault handling as the launcher's
(Note [Worker lifetime] in ``torchacc/launch_checks.py``): the workers die with it (the kernel
kills them when it dies, SIGKILL included); when one rank fails the others are stopped and it
exits with that rank's code and one line saying which; Ctrl-C or SIGTERM stops every rank (SIGTERM,
then SIGKILL after ``--stop-timeout`` seconds) and exits ``128 + signal`` without a traceback.
Several nodes: use ``mpirun`` (``hvd.init()`` reads Open MPI's and MPICH's variables).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from torchacc import launch_checks

_LOCAL = {"localhost", "127.0.0.1", "::1", socket.gethostname()}


def _parser():
    p = argparse.ArgumentParser(
        prog="torchaccrun",
        description="Run a command as N ranks of a torchacc.horovod / torchacc.distributed job.",
    )
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="ranks to start")
    p.add_argument("-H", "--hosts", default=None, help="host:slots,... (this node only)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: free)")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds before SIGKILL")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, e.g. python train.py")
    return p


def _slots(hosts):
    total = 0
    for item in hosts.split(","):
        host, _, n = item.strip().partition(":")
        if host not in _LOCAL:
            raise SystemExit(
                f"torchaccrun: host {host!r} is not this node; torchaccrun starts ranks on one "
                "node only (use mpirun for several)"
            )
        total += int(n or 1)
    return total


def _free_port_pair():
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        if port + 1 < 65536:
            return port
    raise SystemExit("torchaccrun: no free port pair for the rendezvous")


def _die_with_parent():
    launch_checks._set_parent_death_signal(signal.SIGKILL)


def _stop(procs, timeout):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        left = max(deadline - time.monotonic(), 0.0)
        try:
            p.wait(timeout=left)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _Signalled(Exception):
    def __init__(self, signum):
        self.signum = signum


def _raise_signal(signum, frame):
    raise _Signalled(signum)


def main(argv=None):
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("torchaccrun: no command given (e.g. torchaccrun -np 2 python train.py)")
    if args.np < 1:
        raise SystemExit(f"torchaccrun: -np must be at least 1, got {args.np}")
    if args.hosts is not None and _slots(args.hosts) < args.np:
        raise SystemExit(
            f"torchaccrun: -np {args.np} is more than the {_slots(args.hosts)} slot(s) of -H "
            f"{args.hosts}"
        )
    port = args.master_port or _free_port_pair()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD_", "PMI_"))}
    procs = []
    old = {s: signal.signal(s, _raise_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(args.np):
            env = dict(base)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(args.np),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(args.np),
                GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            try:
                procs.append(subprocess.Popen(command, env=env, preexec_fn=_die_with_parent))
            except OSError as e:
                _stop(procs, args.stop_timeout)
                raise SystemExit(f"torchaccrun: cannot start {command[0]!r}: {e}") from None
        while True:
            for rank, p in enumerate(procs):
                code = p.poll()
                if code not in (None, 0):
                    others = [q for q in procs if q.poll() is None]
                    print(
                        f"torchaccrun: rank {rank} exited with code {code}; stopping the other "
                        f"{len(others)} running rank(s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    _stop(procs, args.stop_timeout)
                    return code if code > 0 else 128 - code
            if all(p.poll() == 0 for p in procs):
                return 0
            time.sleep(0.1)
    except _Signalled as s:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        name = signal.Signals(s.signum).name
        print(f"torchaccrun: {name}: stopping {len(procs)} rank(s)", file=sys.stderr, flush=True)
        _stop(procs, args.stop_timeout)
        return 128 + s.signum
    finally:
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
