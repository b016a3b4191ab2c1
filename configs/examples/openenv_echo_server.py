"""An echo-style OpenEnv environment server (configs/examples/openenv_echo.yaml; docs/bring-your-own-task.md):
reset() opens an episode, step({"message": text}) echoes the text back and ends it with reward 1.0 when the
text is one digit, 0.0 otherwise. Run alone: python configs/examples/openenv_echo_server.py --port 8000."""

from __future__ import annotations

import argparse

from openenv.core import Action, Environment, Observation, State, create_fastapi_app


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str = ""


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session has an environment of its own

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(echoed_message="", done=False, reward=None)

    def step(self, action: EchoAction, timeout_s=None, **kwargs) -> EchoObservation:
        self._state.step_count += 1
        text = action.message.strip()
        return EchoObservation(echoed_message=action.message, done=True,
                               reward=1.0 if len(text) == 1 and text.isdigit() else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=64)

if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
