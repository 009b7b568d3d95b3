"""An OpenEnv environment served by openenv-core's own server (create_app + uvicorn), for the
tests: "say the word" — reset(seed) picks a word by the seed, one step, reward 1 when the action's
message contains the word. `--mode` makes it hostile: `big` answers a 5 MB observation, `die`
exits during the second episode's step (a socket closed mid-episode), `schema` serves an action
schema that is not an object's, `drift` words its task differently (as a changed version would).

    python tests/openenv_server.py --port 8000 [--mode ok|big|die|schema|drift]
"""

from __future__ import annotations

import argparse
import os

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "candle"]
MODE = os.environ.get("KILN_TEST_ENV_MODE", "ok")


class SayAction(Action):
    message: str = Field(..., max_length=24, description="what to say")


class SayObservation(Observation):
    prompt: str = Field(default="", description="the task")
    padding: str = Field(default="")


class SayEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    steps_seen = 0

    def __init__(self):
        self._state = State(step_count=0)
        self.word = WORDS[0]

    def reset(self, seed=None, episode_id=None, **_) -> SayObservation:
        self.word = WORDS[(seed or 0) % len(WORDS)]
        self._state = State(step_count=0)
        end = "!" if MODE == "drift" else "."          # drift: the same environment, changed since a rollout
        return SayObservation(prompt=f"Say the word {self.word}{end}", done=False, reward=None)

    def step(self, action: SayAction, **_) -> SayObservation:  # type: ignore[override]
        self._state.step_count += 1
        SayEnvironment.steps_seen += 1
        if MODE == "die" and SayEnvironment.steps_seen >= 2:
            os._exit(3)
        reward = 1.0 if self.word in action.message.lower() else 0.0
        return SayObservation(prompt="done", padding="x" * (5 << 20) if MODE == "big" else "", done=True,
                              reward=reward)

    @property
    def state(self) -> State:
        return self._state


def make_app():
    app = create_app(SayEnvironment, SayAction, SayObservation, env_name="say_the_word", max_concurrent_envs=4)
    if MODE == "schema":
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/schema"]

        @app.get("/schema")
        def schema():
            return {"action": "anything", "observation": {"type": "object"}, "state": {}}
    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="ok")
    args = ap.parse_args()
    os.environ["KILN_TEST_ENV_MODE"] = MODE = args.mode
    import uvicorn
    uvicorn.run(make_app(), host="127.0.0.1", port=args.port, log_level="warning")
