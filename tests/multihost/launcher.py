"""Launch N real processes of a jax.distributed run on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("mh_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    scenario: str, directory: Path | str, count: int = 2, env: dict[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    """Start `count` workers of `scenario`, in process order (the caller waits for them).
    `directory` is a path or an object-store URL (the servers' settings are in os.environ)."""
    port = str(free_port())
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", **(env or {})}
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(i), str(count), port, str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(count)
    ]


def launch(
    scenario: str,
    directory: Path | str,
    count: int = 2,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Run `count` workers of `scenario` to completion (`start`); their results, in process
    order."""
    results = []
    for proc in start(scenario, directory, count, env):
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results
