"""The base class of every config section model in forge, and what its validators share."""

import re

from pydantic import BaseModel, ConfigDict


class ForgeConfigModel(BaseModel):
    """Base for config sections: unknown keys are errors, and so are bad assignments later on.

    `extra="forbid"` is what turns a misspelled key into a start-up error instead of a
    silently ignored setting; `validate_assignment` keeps code that edits a loaded config
    from bypassing the checks. `allow_inf_nan=False`: no setting takes NaN or infinity (a NaN
    reward weight or learning rate would only show as a run that learns nothing); a field
    where infinity means something must say so with `Field(allow_inf_nan=True)`.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def compiled_regex(pattern: str) -> re.Pattern:
    """`pattern` compiled, or the ValueError a validator raises for a setting that is none."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{pattern!r} is not a regular expression ({e})") from None
