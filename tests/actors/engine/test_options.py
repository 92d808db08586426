"""`RequestOptions`: defaults, normalisation, validation, and the one mapping from a worker's
`GenerationRequest` to the options its engine runs it with."""

from __future__ import annotations

import dataclasses

import pytest

from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams
from actors.messages import GenerationRequest

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def test_defaults_are_a_fresh_interactive_request() -> None:
    o = RequestOptions()
    assert (o.extra_keys, o.num_shared_prefix_tokens, o.arrival_time, o.output_token_ids, o.seed) == ((), 0, None, (), None)
    assert (o.hold_kv, o.prefill_only, o.max_chunk_tokens, o.priority_rank, o.holds_kv) == (False, False, None, 0, False)


def test_sequences_become_tuples_of_ints_and_the_options_are_frozen() -> None:
    o = RequestOptions(extra_keys=["tenant:a"], output_token_ids=[True, 7])  # type: ignore[arg-type]
    assert o.extra_keys == ("tenant:a",) and o.output_token_ids == (1, 7)
    assert type(o.output_token_ids[0]) is int
    assert hash(o) == hash(RequestOptions(extra_keys=("tenant:a",), output_token_ids=(1, 7)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.seed = 3  # type: ignore[misc]


def test_prefill_only_holds_kv_and_bad_chunk_caps_are_refused() -> None:
    assert RequestOptions(prefill_only=True).holds_kv and RequestOptions(hold_kv=True).holds_kv
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_chunk_tokens must be >= 1"):
            RequestOptions(max_chunk_tokens=bad)


def test_a_generation_request_maps_to_its_engine_options() -> None:
    req = GenerationRequest("r1", (5, 6, 7), GREEDY, tenant="acme", seed=11, num_shared_prefix_tokens=2,
                            output_token_ids=(9,), max_chunk_tokens=16, priority_rank=1)
    assert req.engine_options() == RequestOptions(
        extra_keys=("tenant:acme",), num_shared_prefix_tokens=2, output_token_ids=(9,), seed=11,
        max_chunk_tokens=16, priority_rank=1, tenant="acme")
    # A prefill worker runs the prompt alone at its full step budget and keeps the KV to ship.
    assert req.engine_options(prefill_only=True) == RequestOptions(
        extra_keys=("tenant:acme",), num_shared_prefix_tokens=2, output_token_ids=(9,), seed=11,
        prefill_only=True, priority_rank=1, tenant="acme")
    # The arrival time is wall clock and stays with the request; the engine stamps its own.
    assert req.engine_options().arrival_time is None
    assert GenerationRequest("r2", (5,), GREEDY, cache_salt=()).engine_options().extra_keys == ()
