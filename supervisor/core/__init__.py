"""The supervisor's core: the daemon's loop, the process table and restart policy, the router, the
placer, configuration. It imports nothing of the front ends or the command bus."""
