"""The registry of bus commands: a command is a named function of the supervisor and its
arguments (supervisor/bus/ defines them, `@command`); the loop runs them by name (`run`) for the
CLI's control socket, the HTTP front end and signal handlers — the core never imports the bus."""

from __future__ import annotations

from typing import Any, Callable

COMMANDS: dict[str, Callable] = {}
OFF_LOOP: set[str] = set()      # commands that read files or processes: run on a thread, not the loop


class CommandError(Exception):
    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


def command(name: str, off_loop: bool = False):
    """Register a bus command. An `off_loop` one may be slow (disk, psutil) and so must only read
    state that is safe from another thread; it never delays the loop's liveness checks."""
    def register(fn):
        COMMANDS[name] = fn
        if off_loop:
            OFF_LOOP.add(name)
        return fn
    return register


def run(sup, name: str, args: dict) -> Any:
    fn = COMMANDS.get(name)
    if fn is None:
        raise CommandError("unknown_command", f"unknown command {name!r} (commands: {', '.join(sorted(COMMANDS))})")
    return fn(sup, args)
