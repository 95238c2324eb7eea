"""A generative judge's question and how its answer becomes a score.

The question is a template with the fields ``{prompt}``, ``{response}`` and ``{target}``
(Python's ``str.format``: write ``{{`` and ``}}`` for literal braces); other fields are refused
when the config loads. The answer is read with a rule (`JudgeParse`): the first group of a
regular expression, searched for in the answer, is a number, and the score is that number
divided by ``scale``. The default finds the last "N/10" in the answer (N from 0 to 10) and
scores N/10. An answer the rule does not match scores the run's ``reward.error_reward`` and is
counted as an error: a judge that does not answer as asked should be seen, not read as a 0.
"""

from __future__ import annotations

import math
import re
import string

from pydantic import Field, field_validator

from forge.config import ForgeConfigModel, compiled_regex

FIELDS = ("prompt", "response", "target")

DEFAULT_TEMPLATE = (
    "Rate how well the response answers the prompt, from 0 (wrong or useless) to 10 (correct "
    "and complete). A reference answer is given when one is known.\n\n"
    "Prompt:\n{prompt}\n\nResponse:\n{response}\n\nReference answer:\n{target}\n\n"
    "Explain briefly, then end with your rating as 'N/10'."
)


def check_template(template: str) -> str:
    """The template, if its fields are among `FIELDS`; else a ValueError naming them."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(
            f"template {template[:80]!r}: {e} (write '{{{{' and '}}}}' for literal braces)"
        ) from None
    unknown = sorted({f for f in fields if f not in FIELDS})
    if unknown:
        raise ValueError(
            f"template {template[:80]!r} has unknown field(s) {unknown}: use only "
            f"{', '.join('{' + f + '}' for f in FIELDS)}, and '{{{{' '}}}}' for literal braces"
        )
    return template


def judge_question(template: str, prompt: str, response: str, target: str) -> str:
    return template.format_map({"prompt": prompt, "response": response, "target": target})


class JudgeParse(ForgeConfigModel):
    # Searched for in the answer (re.search); its first group must be a number. The default
    # takes the last "N/10" ((?s) lets .* run over newlines, and .* is greedy).
    regex: str = r"(?s).*\b(10|[0-9])\s*/\s*10"
    # score = the number / scale.
    scale: float = Field(10.0, gt=0)

    @field_validator("regex")
    @classmethod
    def _one_group(cls, regex: str) -> str:
        compiled = compiled_regex(regex)
        if compiled.groups < 1:
            raise ValueError(f"regex {regex!r} has no group: put the number in parentheses")
        return regex

    def score(self, answer: str) -> float | None:
        """The answer's score, or None when the rule finds no number in it."""
        match = re.search(self.regex, answer)
        if match is None or match.group(1) is None:
            return None
        try:
            value = float(match.group(1)) / self.scale
        except ValueError:
            return None
        return value if math.isfinite(value) else None
