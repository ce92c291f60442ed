"""`Term`, importable from here for a release: it lives in
`keras_penalties.composite.term` (also `keras_penalties.Term`)."""

from keras_penalties.composite.term import Term, build_terms, deserialize_terms, serialize_terms

__all__ = ["Term", "build_terms", "serialize_terms", "deserialize_terms"]
