"""DatasetActor: serves prompts and targets, each naming where it came from (its "origin"), with a
cursor that is saved and restored."""

from __future__ import annotations

from monarch.actor import endpoint

from forge.controller import ForgeActor
from forge.data.prompts import PromptCursor, PromptDataConfig, Row, load_prompt_rows, with_origins


class DatasetActor(ForgeActor):
    def __init__(self, cfg: PromptDataConfig):
        self.cfg = cfg

    @endpoint
    async def setup(self) -> None:
        train, self.eval_rows = with_origins(self.cfg, *load_prompt_rows(self.cfg))
        self.cursor = PromptCursor(train, self.cfg.seed)

    @endpoint
    async def sample(self) -> Row:
        return self.cursor.next()

    @endpoint
    async def sample_batch(self, n: int) -> list[Row]:
        """The next `n` rows, in one call."""
        return [self.cursor.next() for _ in range(n)]

    @endpoint
    async def eval_set(self) -> list[Row]:
        return list(self.eval_rows)

    @endpoint
    async def state_dict(self) -> dict[str, int]:
        return self.cursor.state_dict()

    @endpoint
    async def load_state_dict(self, state: dict[str, int]) -> None:
        self.cursor.load_state_dict(state)
