"""User-facing errors. The CLI prints `str(err)` on one line and exits non-zero, so every message names the
file, tensor or config field at fault."""


class KieError(Exception):
    """Base of every error a user can cause with bad input (never a bug of ours)."""


class ConfigError(KieError):
    """config.json is missing, unreadable or describes something we cannot run."""


class CheckpointError(KieError):
    """Weights are missing, extra, mis-shaped or unreadable."""


class InputError(KieError):
    """A prompt or a generation option is out of range."""


class Unsupported(InputError, NotImplementedError):
    """A backend does not take this model (its family or format) yet: --backend auto moves on to the next one
    without a warning (the reason stays on the chosen backend's auto_note); a named --backend reports it."""
