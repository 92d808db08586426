"""What an attention call over a paged KV cache needs to know about its batch.

The batch is ragged: sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]` (its new
tokens) and attends causally over `seq_lens[i]` tokens of context whose KV lives in the blocks
`block_tables[i, :ceil(seq_lens[i] / block_size)]`. The new tokens are the *last* query_len tokens of
that context (their KV is written before attention runs). Sequences with exactly one query row
(decodes) come first, `num_decodes` of them, so they can be served by one batched decode kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot of each new token
    num_decodes: int  # leading sequences with query_len == 1
    max_seq_len: int
    # Host copies, so the CPU path never syncs to read shapes.
    query_start_loc_list: tuple[int, ...] = ()
    seq_lens_list: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

