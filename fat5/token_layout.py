"""Where the real tokens of a batch are: padded rows with their mask, or packed rows cut into segments.

The stacks build one layout per call (the seq2seq models build the encoder's once for both stacks), and every
attention of the stack reads it: the positions, the key padding mask or a custom 4-D mask, the varlen segments.
"""

from dataclasses import dataclass

import torch


@dataclass
class TokenLayout:
    """Where the real tokens of a (batch, length) block of hidden states are.

    Padded batches carry a ``padding_mask``. Packed batches (several examples per row) are cut into segments for the
    varlen attention, which keeps examples apart: each row into one segment per example slot of the batch (empty
    where the row holds fewer examples) and a last one for its padding tail. The segments then follow the tokens'
    own row-major order, so the hidden states reach the varlen attention as a view, with no gather or scatter; a
    padding tail attends only to itself, and the loss never reads what it produces. ``examples`` says which example
    slots of each row hold tokens (the decoder's must match the encoder's; None for a layout the caller built, see
    :meth:`given`). ``position_ids`` restart at 0 in every
    segment (packed) or start at ``query_offset``, the cache length when decoding: an int, or a one-element tensor
    with a static cache, whose length lives on the device. ``attention_mask``: a custom 4-D mask, (batch, 1, query,
    key), as transformers' models take one (bool, True where a key may be attended, or float, added to the scores):
    the whole mask of the attentions that read these tokens as keys, which then run the materialising reference.
    """

    position_ids: torch.Tensor
    query_offset: int | torch.Tensor = 0
    padding_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    examples: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    @classmethod
    def padded(
        cls, batch_size, length, attention_mask=None, offset=0, device=None, mask_name="attention_mask"
    ) -> "TokenLayout":
        """A mask must cover the cached tokens and the new ones, ``offset + length``: a (batch, keys) padding mask, or
        a custom (batch, 1, query, keys) one whose query dimension the attention checks (the encoder's mask serves
        the decoder's cross-attention too, as in T5). With a static cache the offset is a tensor on the device, not
        read back here: the attention pads a padding mask to the cache's whole buffer."""
        position_ids = (torch.arange(length, device=device) + offset).expand(batch_size, length)
        if attention_mask is None:
            return cls(position_ids=position_ids, query_offset=offset)
        if attention_mask.dim() not in (2, 4) or attention_mask.shape[0] != batch_size or (
            attention_mask.dim() == 4 and attention_mask.shape[1] != 1
        ):
            raise ValueError(
                f"{mask_name} must be (batch, length) or a custom (batch, 1, query_length, key_length) mask, with "
                f"batch {batch_size}; got {tuple(attention_mask.shape)}"
            )
        if isinstance(offset, int) and attention_mask.shape[-1] != offset + length:
            cached = f" ({offset} cached and {length} new)" if offset else ""
            raise ValueError(
                f"{mask_name}: the attention mask covers {attention_mask.shape[-1]} positions but there are "
                f"{offset + length} tokens{cached}"
            )
        if attention_mask.dim() == 2:
            padding_mask = attention_mask.to(device=device, dtype=torch.bool)
            return cls(position_ids=position_ids, query_offset=offset, padding_mask=padding_mask)
        if attention_mask.dtype != torch.bool and not attention_mask.dtype.is_floating_point:
            raise ValueError(
                f"a 4-D {mask_name} is bool (True where a key may be attended) or float (added to the scores: 0 or a "
                f"large negative), as transformers' 4-D masks; got {attention_mask.dtype}"
            )
        return cls(position_ids=position_ids, query_offset=offset, attention_mask=attention_mask.to(device))

    @classmethod
    def packed(cls, segment_ids: torch.Tensor) -> "TokenLayout":
        """From (batch, length) segment ids: 1, 2, ... for the examples of a row, in order, then 0 on padding.

        Two reads back to the host (the number of example slots with the validity check, then the longest
        segment), both before any of the model's kernels."""
        if segment_ids.dim() != 2 or segment_ids.dtype.is_floating_point:
            raise ValueError(
                "segment_ids must be a (batch, length) integer tensor, "
                f"got {segment_ids.dtype} {tuple(segment_ids.shape)}"
            )
        batch_size, length = segment_ids.shape
        ids = segment_ids.long()
        if ids.numel() == 0:
            empty = torch.zeros(1, dtype=torch.int32, device=ids.device)
            return cls(position_ids=ids, cu_seqlens=empty, examples=ids.new_zeros((batch_size, 0), dtype=torch.bool))
        # padding takes the slot after the last example, so that a valid row's slots never decrease
        slots_per_row = ids.max() + 1
        slots = torch.where(ids > 0, ids - 1, slots_per_row - 1)
        invalid = (ids < 0).any() | (slots[:, 1:] < slots[:, :-1]).any()
        slots_per_row, invalid = torch.stack([slots_per_row, invalid.long()]).tolist()
        if invalid:
            raise ValueError(
                "segment_ids must number each row's examples 1, 2, 3, ... in increasing order, each in one contiguous "
                "run, with padding (0) only after a row's last example"
            )
        row_slots = (torch.arange(batch_size, device=ids.device)[:, None] * slots_per_row + slots).flatten()
        counts = torch.bincount(row_slots, minlength=batch_size * slots_per_row)
        cu_seqlens = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=ids.device)
        cu_seqlens[1:] = torch.cumsum(counts, 0)
        positions = torch.arange(row_slots.numel(), device=ids.device) - cu_seqlens[:-1].long()[row_slots]
        return cls(
            position_ids=positions.view(batch_size, length),
            cu_seqlens=cu_seqlens,
            max_seqlen=int(counts.max()),
            examples=counts.view(batch_size, slots_per_row)[:, :-1] > 0,
        )

    @classmethod
    def given(cls, segment_ids: torch.Tensor, cu_seqlens: torch.Tensor, position_ids: torch.Tensor,
              name: str = "") -> "TokenLayout":
        """A packed layout that the caller built (the UL2 collator does, in the dataloader's workers), so that the
        step reads nothing back from the device: only shapes and dtypes are checked here.

        ``cu_seqlens`` may cut the tokens into any segments that follow the row-major order and never cross a row;
        empty segments (repeated offsets) are allowed, so that a batch of fixed shape can hold a varying number of
        examples. ``max_seqlen`` is the row length, an upper bound known without a device read (the kernels' grid
        covers it; the segments' true lengths come from ``cu_seqlens``)."""
        prefix = f"{name}_" if name else ""
        batch_size, length = segment_ids.shape
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.numel() < 2:
            raise ValueError(
                f"{prefix}cu_seqlens must be a 1-D integer tensor of segment offsets (0, ..., {batch_size * length}), "
                f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
            )
        if position_ids is None or tuple(position_ids.shape) != (batch_size, length):
            shape = None if position_ids is None else tuple(position_ids.shape)
            raise ValueError(
                f"{prefix}cu_seqlens comes with {prefix}segment_position_ids of the segment ids' shape "
                f"{(batch_size, length)} (each token's position in its segment), got {shape}"
            )
        device = segment_ids.device
        return cls(
            position_ids=position_ids.to(device, non_blocking=True),
            cu_seqlens=cu_seqlens.to(device, torch.int32, non_blocking=True),
            max_seqlen=length,
        )
