"""Where each config value came from, so that an error can point at a file line or an override."""

from dataclasses import dataclass, field

from forge.config.keys import KeyPath, normalize


@dataclass
class ConfigSources:
    file: str | None
    # key path -> 1-based line of that key in `file`
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)
    # key path -> text of the last command-line override that set or deleted it
    overrides: dict[tuple[str, ...], str] = field(default_factory=dict)

    def describe(self, path: KeyPath) -> str | None:
        """Name the origin of the value at `path`, or None when it has no origin (no file, no override)."""
        keys = normalize(path)
        prefixes = [keys[:n] for n in range(len(keys), 0, -1)]
        # Overrides are applied after the file, so an override of the key or of a parent wins.
        for prefix in prefixes:
            if prefix in self.overrides:
                return f"command-line override '{self.overrides[prefix]}'"
        # A key the file does not have was created by an override of a key below it
        # (`trainer.optimzer.lr=1` creates `trainer.optimzer`).
        if keys and keys not in self.lines:
            for override_keys, text in self.overrides.items():
                if override_keys[: len(keys)] == keys:
                    return f"command-line override '{text}'"
        if self.file is None:
            return None
        for prefix in prefixes:
            if prefix in self.lines:
                return f"{self.file}:{self.lines[prefix]}"
        return self.file

    def with_source(self, path: KeyPath, text: str) -> str:
        source = self.describe(path)
        return f"{source}: {text}" if source else text
