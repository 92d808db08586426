"""Named errors of the engine: expected events and bad input, each with a clear message.

The HTTP layer maps them to status codes (InvalidRequest -> 400, ContextLengthExceeded -> 400,
ModelNotFound -> 404); the engine raises them before touching its state, so one bad request
never disturbs the others.
"""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequest(EngineError, ValueError):
    """The request itself is malformed (empty prompt, bad token ids, bad sampling values)."""


class EmptyPrompt(InvalidRequest):
    pass


class TokenOutOfVocab(InvalidRequest):
    pass


class InvalidSamplingParams(InvalidRequest):
    pass


class ContextLengthExceeded(InvalidRequest):
    """prompt + max_tokens does not fit the model's context."""


class DuplicateRequestId(InvalidRequest):
    pass


class ModelNotFound(EngineError, FileNotFoundError):
    """A model name or path that resolves to nothing loadable."""


class ModelFetchError(EngineError, RuntimeError):
    """A model could not be downloaded into the cache."""


class UnsupportedModel(EngineError, ValueError):
    """A model file whose architecture or tensor types ferry does not handle."""
