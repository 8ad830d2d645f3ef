"""T5's relative position bias inside flash-attn-4's Hopper (SM90) attention kernels, the table's gradient included.

flash-attn-4's SM90 forward and backward kernels (CuTe DSL) call a hook on every tile of scores they compute:
``apply_score_mod`` on the fp32 scores (forward, and the backward's recomputation), ``apply_score_mod_bwd`` on the
tile's score gradient, each with the tile's query block ``m_block`` and key block ``n_block``. The classes here
override those two hooks; everything else (TMA loads, warp-specialised pipelines, the online softmax, the backward's
five products) is FA4's. FA4's own score_mod path calls a user function per score with wrapped indices, which
measured 0.40-0.49x FA4 without bias for a per-score bias read (H100, benchmarks/README.md); a tile-aware hook reads
what the tile needs.

T5's bias depends on ``rel = key - query`` alone (FA4 serves FAT5's T5 problems with query offset 0), and every
``|rel| > D`` (D = max_distance) falls in the last bucket of its direction:

* Scores: a tile lying wholly beyond ``D`` on one side adds one value, read once. A "near" tile reads the bias per
  score from the head's row ``bias[h, clamp(rel, -D-1, D+1) + D + 1]`` (natural units, 2D+3 values, L1-resident).
* Table gradient: each bucket's share is the sum of the score gradient ``dS`` over its scores. The backward hook sums
  ``dS`` beyond ``D`` (``rel < -D``, ``rel > D``): a far tile whole, a near tile's far scores by their ``rel``; each
  warp reduces its two sums and adds them to the ends of ``grad_by_distance[h, n_block % slots]``, the row of sums by
  clamped relative position, with fp32 atomics (their order varies run to run: those two buckets' gradients vary in
  their last bits; the slots spread one head's atomics). The band ``|rel| <= D`` (2D+1 diagonals) is summed by
  ``rel`` in a Triton pass that recomputes only the band's tiles (``attention_triton_launch.t5_band_table_gradient``).
  Summing the band here instead, each score added to a per-warp row of shared memory, measured slower (H200:
  0.48x / 0.80x cuDNN without bias at L 1024 / 4096 against the pass's 0.63x / 0.88x, benchmarks/README.md).

FA4's interface builds its SM90 kernel objects from module-level class names; ``attention_fa4`` swaps these classes in
for the call (``t5_kernel_classes``), and passes ``score_mod`` / ``score_mod_bwd`` stand-ins that key FA4's compile
cache and raise if a kernel other than these ever calls them.
"""

import functools
import hashlib
from pathlib import Path

try:
    import cutlass
    from cutlass import Float32, Int32, const_expr, cute
    from flash_attn.cute import utils as fa4_utils
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.utils import AuxData
except ImportError as error:  # attention_fa4.py imports this module only once flash-attn-4 is known to be installed
    raise ImportError(f"FAT5's Hopper T5-bias kernels need flash-attn-4 and the CuTe DSL: {error}") from error

# part of FA4's compile-cache key (through the stand-ins' hash): an edit of these hooks compiles new kernels
_SOURCE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


@cute.jit
def _relative_position(coordinate, key_minus_query: Int32, keys_first: cutlass.Constexpr[bool]) -> Int32:
    """``rel`` of one score: ``coordinate`` is its (row, column) in the tile, (key, query) when ``keys_first``;
    ``key_minus_query`` the tile's first key minus its first query."""
    if const_expr(keys_first):
        return key_minus_query + coordinate[0] - coordinate[1]
    return key_minus_query + coordinate[1] - coordinate[0]


@cute.jit
def _add_t5_bias(
    acc_S: cute.Tensor,
    tScS: cute.Tensor,
    bias_by_distance: cute.Tensor,
    head_idx: Int32,
    key_minus_query: Int32,
    softmax_scale: Float32,
    tile_queries: cutlass.Constexpr[int],
    tile_keys: cutlass.Constexpr[int],
    max_distance: cutlass.Constexpr[int],
    keys_first: cutlass.Constexpr[bool],
):
    """``acc_S = acc_S * softmax_scale + bias`` for one tile (FA4 applies the scale in the hook when a score_mod is
    set). The branch is uniform over the tile, hence over every warp."""
    lowest = key_minus_query - (tile_queries - 1)
    highest = key_minus_query + (tile_keys - 1)
    if lowest > max_distance:
        far_right = bias_by_distance[head_idx, 2 * max_distance + 2]
        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
            acc_S[i] = acc_S[i] * softmax_scale + far_right
    else:
        if highest < -max_distance:
            far_left = bias_by_distance[head_idx, 0]
            for i in cutlass.range(cute.size(acc_S), unroll_full=True):
                acc_S[i] = acc_S[i] * softmax_scale + far_left
        else:
            for i in cutlass.range(cute.size(acc_S), unroll_full=True):
                rel = _relative_position(tScS[i], key_minus_query, keys_first)
                index = cutlass.min(cutlass.max(rel, -(max_distance + 1)), max_distance + 1) + (max_distance + 1)
                acc_S[i] = acc_S[i] * softmax_scale + bias_by_distance[head_idx, index]


@cute.jit
def _add_far_grad(
    grad_S: cute.Tensor,
    tScS: cute.Tensor,
    grad_by_distance: cute.Tensor,
    head_idx: Int32,
    n_block: Int32,
    key_minus_query: Int32,
    tile_queries: cutlass.Constexpr[int],
    tile_keys: cutlass.Constexpr[int],
    max_distance: cutlass.Constexpr[int],
    keys_first: cutlass.Constexpr[bool],
):
    """Add this tile's score gradient beyond ``D`` on either side, as two warp sums, to the ends of
    ``grad_by_distance[head, n_block % slots]``, the row of sums by clamped relative position."""
    lowest = key_minus_query - (tile_queries - 1)
    highest = key_minus_query + (tile_keys - 1)
    slot = n_block % cute.size(grad_by_distance, mode=[1])
    left = Float32(0.0)
    right = Float32(0.0)
    if lowest > max_distance:
        for i in cutlass.range(cute.size(grad_S), unroll_full=True):
            right += grad_S[i]
    else:
        if highest < -max_distance:
            for i in cutlass.range(cute.size(grad_S), unroll_full=True):
                left += grad_S[i]
        else:
            if lowest < -max_distance or highest > max_distance:
                for i in cutlass.range(cute.size(grad_S), unroll_full=True):
                    rel = _relative_position(tScS[i], key_minus_query, keys_first)
                    left += grad_S[i] if rel < -max_distance else Float32(0.0)
                    right += grad_S[i] if rel > max_distance else Float32(0.0)
    left = fa4_utils.warp_reduction_sum(left)
    right = fa4_utils.warp_reduction_sum(right)
    if cute.arch.lane_idx() == 0:
        fa4_utils.atomic_add_fp32(left, fa4_utils.elem_pointer(grad_by_distance, (head_idx, slot, 0)))
        fa4_utils.atomic_add_fp32(right, fa4_utils.elem_pointer(grad_by_distance,
                                                                (head_idx, slot, 2 * max_distance + 2)))


def _stand_in(name: str, max_distance: int, table_grad: bool):
    """A score_mod for FA4's interface: its hash keys the compile cache; the kernels here never call it."""

    def stand_in(*_args, **_kwargs):
        raise RuntimeError(f"FAT5's T5-bias {name} ran in a flash-attn-4 kernel other than FAT5's Hopper T5 kernels")

    stand_in.__cute_hash__ = f"fat5-t5-{name}-{max_distance}-{table_grad}-{_SOURCE_HASH}"
    return stand_in


@functools.cache
def t5_kernel_classes(max_distance: int, table_grad: bool):
    """(forward class, backward class, score_mod stand-in, score_mod_bwd stand-in) for T5's bias with this
    ``max_distance``; ``table_grad`` False leaves the backward's far sums out (a frozen table)."""

    class T5BiasForwardSm90(FlashAttentionForwardSm90):
        @cute.jit
        def apply_score_mod(self, thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block, softmax_scale, seqlen,
                            aux_data: AuxData, fastdiv_mods):
            tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            _add_t5_bias(acc_S, tScS, aux_data.tensors[0], head_idx, n_block * self.tile_n - m_block * self.tile_m,
                         softmax_scale, self.tile_m, self.tile_n, max_distance, False)

    class T5BiasBackwardSm90(FlashAttentionBackwardSm90):
        def _score_coordinates(self, thr_mma_SdP):
            shape = (self.tile_n, self.tile_m) if const_expr(self.SdP_swapAB) else (self.tile_m, self.tile_n)
            return thr_mma_SdP.partition_C(cute.make_identity_tensor(shape))

        @cute.jit
        def apply_score_mod(self, acc_S, thr_mma_SdP, batch_idx, head_idx, m_block, n_block, softmax_scale,
                            seqlen_info, aux_data: AuxData, fastdiv_mods):
            _add_t5_bias(acc_S, self._score_coordinates(thr_mma_SdP), aux_data.tensors[0], head_idx,
                         n_block * self.tile_n - m_block * self.tile_m, softmax_scale, self.tile_m, self.tile_n,
                         max_distance, self.SdP_swapAB)

        @cute.jit
        def apply_score_mod_bwd(self, grad_tensor, score_tensor, thr_mma_SdP, batch_idx, head_idx, m_block, n_block,
                                softmax_scale, seqlen_info, aux_data: AuxData, fastdiv_mods):
            # an additive bias leaves the score gradient as it is: only the table's far buckets are summed here
            if const_expr(table_grad):
                _add_far_grad(grad_tensor, self._score_coordinates(thr_mma_SdP), aux_data.tensors[1], head_idx,
                              n_block, n_block * self.tile_n - m_block * self.tile_m, self.tile_m, self.tile_n,
                              max_distance, self.SdP_swapAB)

    return (T5BiasForwardSm90, T5BiasBackwardSm90, _stand_in("score_mod", max_distance, table_grad),
            _stand_in("score_mod_bwd", max_distance, table_grad))
