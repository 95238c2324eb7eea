"""The one exception type for configuration mistakes a user can fix."""


class ConfigError(Exception):
    """A user-facing configuration problem.

    `problems` holds one line per problem, so that a config with several mistakes is fixed
    in one round instead of one start-up per mistake.
    """

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} problems in the configuration:\n" + "\n".join(
                f"  {problem}" for problem in self.problems
            )
        super().__init__(text)
