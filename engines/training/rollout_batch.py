"""The rollout table as one typed batch of tensors (`RolloutBatch`): what the reference forwards and
the critic's and actor's updates take. The table it comes from, its column schema and the one
table -> tensors conversion live in engines/data/rollout_table.py, so the update path imports no pandas.
Layout (verl style, engines/models/batching.py): prompts left-padded to P, responses right-padded to T.
Notation: B rows (= prompts × G samples), P prompt width, T response width, K turns (agentic).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engines.models.batching import TokenBatch


@dataclass(frozen=True)
class RolloutBatch:
    """A rollout table as tensors (engines/data/rollout_table.py `batch_from_table`). Token-level float columns are zero-padded on the
    right; a column the table does not have (yet) is None.

    input_ids ... response_mask: the padded tokens, as `TokenBatch` holds them (`tokens()`)
    response_lengths: tokens in each row's `response_token_ids`
    scores, group_index, truncated: `reward`, `group_id` (factorized in row order), `finish_reason == "length"`
    turn_index, step_rewards, step_state_ids: GiGPO's per-turn structure of agentic rows
        (engines/algorithms/gigpo.py `gigpo_step_tensors`), when the table has turn_index,
        turn_rewards and state_keys
    """

    input_ids: torch.Tensor                          # [B, P+T] long
    attention_mask: torch.Tensor                     # [B, P+T] long, 1 on real tokens
    position_ids: torch.Tensor                       # [B, P+T] long
    responses: torch.Tensor                          # [B, T] long
    response_mask: torch.Tensor                      # [B, T] float32, 1 on response tokens the loss sees (loss_mask)
    response_lengths: torch.Tensor                   # [B] long
    scores: torch.Tensor | None = None               # [B] float32
    group_index: torch.Tensor | None = None          # [B] long
    truncated: torch.Tensor | None = None            # [B] bool
    behaviour_logprobs: torch.Tensor | None = None   # [B, T] float32
    ref_logprobs: torch.Tensor | None = None         # [B, T] float32
    old_logprobs: torch.Tensor | None = None         # [B, T] float32
    values: torch.Tensor | None = None               # [B, T] float32
    turn_index: torch.Tensor | None = None           # [B, T] long, -1 on environment tokens
    step_rewards: torch.Tensor | None = None         # [B, K] float32
    step_state_ids: torch.Tensor | None = None       # [B, K] long, -1 past a row's turns

    @property
    def size(self) -> int:
        """B, the number of rows."""
        return self.input_ids.shape[0]

    def tokens(self, loss_mask: bool = True) -> TokenBatch:
        """The padded tokens as a `TokenBatch` (the same tensors). `loss_mask=False`: its
        response_mask is 1 on every response token (the forwards of the reference stage)."""
        mask = self.response_mask
        if not loss_mask:
            mask = self.attention_mask[:, self.input_ids.shape[1] - self.responses.shape[1]:].to(torch.float32)  # [B, T]
        return TokenBatch(self.input_ids, self.attention_mask, self.position_ids, self.responses, mask)

    def with_response_mask(self, response_mask: torch.Tensor) -> "RolloutBatch":
        """The same batch with `response_mask` [B, T] (the one the update's masks leave)."""
        return replace(self, response_mask=response_mask)
