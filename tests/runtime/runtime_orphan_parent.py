"""Helper program for test_runtime_orphans: a parent with two child actors that prints
their pids as one JSON line, then idles until it is killed."""

from __future__ import annotations

import asyncio
import json
import sys

from treeserve.runtime import Runtime, RuntimeConfig
from treeserve_testing.runtime_actors import WorkerActor


async def main() -> None:
    async with Runtime(RuntimeConfig()) as rt:
        a = await rt.spawn(WorkerActor, name="with-pdeathsig", process="child")
        b = await rt.spawn(WorkerActor, name="pipe-only", process="child", use_pdeathsig=False)
        pids = {"pdeathsig": await a.ask("pid"), "pipe_only": await b.ask("pid")}
        sys.stdout.write(json.dumps({"pids": pids, "endpoint": rt.endpoint}) + "\n")
        sys.stdout.flush()
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main())
