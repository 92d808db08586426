"""Speculative decoding: drafts proposed cheaply, verified by one forward of the target model
(`decoder.SpecDecoder`, which the engine drives; import it from there: this package's root stays
light, as the engine's config imports `SpecConfig` from it)."""

from actors.engine.spec.config import SpecConfig

__all__ = ["SpecConfig"]
