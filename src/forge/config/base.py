"""The base class of every config section model in forge."""

from pydantic import BaseModel, ConfigDict


class ForgeConfigModel(BaseModel):
    """Base for config sections: unknown keys are errors, and so are bad assignments later on.

    `extra="forbid"` is what turns a misspelled key into a start-up error instead of a
    silently ignored setting; `validate_assignment` keeps code that edits a loaded config
    from bypassing the checks.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
