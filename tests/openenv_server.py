"""An OpenEnv environment served by openenv-core's own server (create_app + uvicorn), for the
tests: "say the word" — reset(seed) picks a word by the seed, one step, reward 1 when the action's
message contains the word. `--mode` makes it hostile: `big` answers a 5 MB observation, `die`
exits during the second episode's step (a socket closed mid-episode), `schema` serves an action
schema that is not an object's, `drift` words its task differently (as a changed version would),
`twice` asks for the word twice (two steps, half the reward each: an episode of several steps).

    python tests/openenv_server.py --port 8000 [--mode ok|big|die|schema|drift|twice ...]

Each mode is served under its own path (http://127.0.0.1:8000/twice): one process holds several
(openenv-core takes seconds to import) — except `die`, which ends its process.
"""

from __future__ import annotations

import argparse
import os

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "candle"]


class SayAction(Action):
    message: str = Field(..., max_length=24, description="what to say")


class SayObservation(Observation):
    prompt: str = Field(default="", description="the task")
    padding: str = Field(default="")


class SayEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    steps_seen = 0
    mode = "ok"

    def __init__(self):
        self._state = State(step_count=0)
        self.word = WORDS[0]

    def reset(self, seed=None, episode_id=None, **_) -> SayObservation:
        self.word = WORDS[(seed or 0) % len(WORDS)]
        self._state = State(step_count=0)
        end = "!" if self.mode == "drift" else "."          # drift: the same environment, changed since a rollout
        return SayObservation(prompt=f"Say the word {self.word}{end}", done=False, reward=None)

    def step(self, action: SayAction, **_) -> SayObservation:  # type: ignore[override]
        self._state.step_count += 1
        SayEnvironment.steps_seen += 1
        if self.mode == "die" and SayEnvironment.steps_seen >= 2:
            os._exit(3)
        reward = 1.0 if self.word in action.message.lower() else 0.0
        if self.mode == "twice":
            first = self._state.step_count == 1
            return SayObservation(prompt="Say it again." if first else "done", done=not first, reward=reward / 2)
        return SayObservation(prompt="done", padding="x" * (5 << 20) if self.mode == "big" else "", done=True,
                              reward=reward)

    @property
    def state(self) -> State:
        return self._state


def make_app(mode: str):
    env = type("SayEnvironment", (SayEnvironment,), {"mode": mode})   # the name is in the metadata
    app = create_app(env, SayAction, SayObservation, env_name="say_the_word", max_concurrent_envs=4)
    if mode == "schema":
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/schema"]

        @app.get("/schema")
        def schema():
            return {"action": "anything", "observation": {"type": "object"}, "state": {}}
    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", nargs="+", default=["ok"])
    args = ap.parse_args()
    import uvicorn
    from fastapi import FastAPI
    root = FastAPI()
    for m in args.mode:
        root.mount(f"/{m}", make_app(m))
    uvicorn.run(root, host="127.0.0.1", port=args.port, log_level="warning")
