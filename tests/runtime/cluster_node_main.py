"""Helper program for the cluster tests: a node that joins the head given on the
command line (what ``treeserve node --join`` does), prints one JSON line once it is
registered, and exits when the head goes away (status 0) or drops it (status 3)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from treeserve.runtime import ActorRef, SupervisorConfig
from treeserve.runtime.cluster import NodeConfig, NodeExit, join


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("head")
    parser.add_argument("--devices", default=None, help="comma-separated; default: detect")
    parser.add_argument("--ping-interval", type=float, default=0.25)
    parser.add_argument("--ping-misses", type=int, default=6)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    config = NodeConfig(
        devices=None if args.devices is None else tuple(args.devices.split(",")),
        supervisor=SupervisorConfig(heartbeat_interval_s=0.2, heartbeat_misses=5, start_timeout_s=30.0),
        ping_interval_s=args.ping_interval,
        ping_misses=args.ping_misses,
        register_timeout_s=20.0,
        name="test-node",
    )

    def ready(agent: ActorRef) -> None:
        sys.stdout.write(json.dumps({"agent": agent.endpoint}) + "\n")
        sys.stdout.flush()

    reason = asyncio.run(join(args.head, node_config=config, on_ready=ready))
    return 0 if reason is NodeExit.HEAD_LOST else 3


if __name__ == "__main__":
    sys.exit(main())
