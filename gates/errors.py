"""The gates' own refusal: ``BadInput`` (exit 2 on the CLI). The model's refusals are ``model.flags.ConfigError``."""


class BadInput(ValueError):
    """Input the gates refuse (exit 2): the message names the key and its value."""
