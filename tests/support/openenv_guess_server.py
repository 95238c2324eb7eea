"""A number-guessing OpenEnv environment server, built with openenv-core's own server helpers.

    python tests/support/openenv_guess_server.py --port 8000 [--max-sessions 2]

The action is ``{"message": "<guess>"}``; the observation's ``message`` says how the guess did.
Each WebSocket session gets its own ``GuessEnvironment``. ``reset`` takes the secret from its
``target`` keyword (or draws it from ``seed``). A step's reward depends on the guess: 1.0 for the
secret, ``-distance/100`` for another number, None (unscored) for text that is not a number. The
episode ends at the secret or after ``MAX_GUESSES`` numbers.
"""

from __future__ import annotations

import argparse
import random

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app

MAX_GUESSES = 3


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    message: str = ""
    guesses: int = 0


class GuessEnvironment(Environment):
    # Each session's instance keeps its own secret and count: sessions may run concurrently.
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State()
        self.secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, target: int | None = None):
        self._state = State(episode_id=episode_id)
        self.secret = int(target) if target is not None else random.Random(seed).randint(1, 100)
        return GuessObservation(message=f"Guess my number (1-100), in at most {MAX_GUESSES} tries.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs):
        text = action.message.strip()
        try:
            guess = int(text)
        except ValueError:
            return GuessObservation(message=f"'{text}' is not a number.", guesses=self._state.step_count)
        self._state.step_count += 1
        count = self._state.step_count
        if guess == self.secret:
            return GuessObservation(message="Correct!", guesses=count, reward=1.0, done=True)
        reward = -abs(guess - self.secret) / 100
        if count >= MAX_GUESSES:
            message = f"No more tries: it was {self.secret}."
            return GuessObservation(message=message, guesses=count, reward=reward, done=True)
        hint = "higher" if guess < self.secret else "lower"
        return GuessObservation(message=f"{guess}: {hint}.", guesses=count, reward=reward)

    @property
    def state(self) -> State:
        return self._state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-sessions", type=int, default=2, help="concurrent WebSocket sessions")
    args = parser.parse_args()
    app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=args.max_sessions)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
