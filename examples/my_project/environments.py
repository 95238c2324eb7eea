"""An environment of this project's own, named in my_project.yaml as `environments:SecondChance`.

The model answers an addition; a wrong answer gets one more turn with a hint, and a right one
on the second turn earns half the reward. One instance serves one trajectory.
"""

from forge.envs import Environment, EnvStep


class SecondChance(Environment):
    def __init__(self, second_try_reward: float = 0.5):
        self.second_try_reward = second_try_reward
        self.turn = 0

    async def reset(self, row: dict) -> list[dict]:
        self.target = row["target"]
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text: str) -> EnvStep:
        self.turn += 1
        if text.strip() == self.target:
            return EnvStep(reward=1.0 if self.turn == 1 else self.second_try_reward, done=True)
        if self.turn == 1:
            return EnvStep([{"role": "user", "content": "no, again:"}])
        return EnvStep(done=True)
