"""Run a script as two nodes of 2 processes each on this machine: two torchrun agents, or two Lightning launches.

    python tests/two_nodes.py torchrun SCRIPT [ARGS...]    two agents, one c10d rendezvous on localhost
    python tests/two_nodes.py lightning SCRIPT [ARGS...]   NODE_RANK=0 and 1, MASTER_ADDR/PORT on localhost

A torchrun agent runs ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:PORT`` (the first hosts the rendezvous store: ``is_host``), as on two machines; a Lightning
launch runs ``python SCRIPT ARGS`` with the environment Lightning reads on a cluster it does not manage
(the script asks for 2 nodes of 2 devices). Both nodes start together; each node's output is printed
under a heading; the exit code is 0 when both nodes exit 0. The port is one the system reports free
just before; ``--timeout`` (default 600 s) bounds the whole run, both nodes killed with their ranks.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def node_commands(launcher: str, script: list[str], port: int) -> list[tuple[list[str], dict[str, str]]]:
    """Each node's command and environment."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"]
        return [([*agent, "--rdzv-conf", f"is_host={node == 0}", *script], environment) for node in (0, 1)]
    return [([sys.executable, *script], {**environment, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                         "NODE_RANK": str(node)}) for node in (0, 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("launcher", choices=("torchrun", "lightning"))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("script", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    nodes = [subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for command, environment in node_commands(args.launcher, args.script, free_port())]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=args.timeout)[0])
    except subprocess.TimeoutExpired:
        outputs.append(f"timed out after {args.timeout:.0f} s")
    finally:
        for node in nodes:  # each node leads its own session: its ranks go with it
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    outputs += ["(not read: an earlier node timed out)"] * (len(nodes) - len(outputs))
    for number, (node, output) in enumerate(zip(nodes, outputs)):
        print(f"== node {number} (exit {node.returncode}) ==\n{output}")
    return 0 if all(node.returncode == 0 for node in nodes) else 1


if __name__ == "__main__":
    sys.exit(main())
