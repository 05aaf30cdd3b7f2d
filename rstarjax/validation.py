"""How a typed config states its rules (imports nothing, so every layer may use it).

Each config dataclass checks its own fields in ``__post_init__`` with ``require``: every broken
rule becomes one line of a single ``ConfigError``, each line starting with the field's name
(``"max_turns=0 must be >= 1"``). ``recipes/config.py`` turns a run's ConfigDict into these
dataclasses, prefixes each line with its flag (``--config.rl.``) and adds the rules that span
sections, files or devices, so a run reports every problem at once.
"""


class ConfigError(ValueError):
    """A configuration that cannot run; one problem per line, each saying how to fix it."""


class StageError(ValueError):
    """A workdir / init_from combination that cannot be resumed or started (the message says why)."""


def require(*rules: tuple[bool, str]) -> None:
    """Raise ConfigError listing the message of every rule whose condition is False."""
    broken = [message for ok, message in rules if not ok]
    if broken:
        raise ConfigError("\n".join(broken))


def one_of(field: str, value, choices) -> tuple[bool, str]:
    """The rule that a named choice is one of ``choices``."""
    return value in choices, f"{field}={value!r}: choose one of {sorted(choices)}"
