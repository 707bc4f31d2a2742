"""Triton kernels, one op per file.

Each kernel file holds a private `@triton.jit` kernel, a public launcher with keyword
arguments that checks shapes, dtypes and strides (_checks.py), and its torch twin
`<launcher>_ref` beside it. Launchers take CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1 (tests).

Attention and the KV pool: extend_attention.py (prefill over the cached prefix),
decode_attention.py (split along the sequence), mla_extend.py, mla_decode.py and mla_prep.py
(DeepSeek's latent attention), store_kv.py, fp8_kv.py (fp8 pools), flat_slots.py (the page
table FlashInfer reads).
Layers: rmsnorm.py (with the residual add), rotary.py and rope_freq.py, gated_act.py,
argmax.py (the greedy token), bitmask.py (grammar masks on the logits).
Products of bf16/fp16 weights: gemv.py (decode's few rows), head_gemv.py (per-head products).
fp8 weights: fp8_weights.py (layouts), fp8_gemv.py and fp8_gemv_packed.py (decode's few rows),
fp8_gemm.py (decode batches to 32 rows), fp8_act_quant.py with fp8_block_gemm.py (w8a8 past
that), fp8_widen.py and f16x2.py (helpers).
int4 weights: w4a16.py (the layout), w4a16_mma.py (decode's 1 to 64 rows on the tensor
cores' MMA, words shuffled at load) and w4a16_mma_dequant.py (their expansion for prefill),
w4a16_gemv.py and w4a16_gemm.py (fp32 models and shapes the MMA does not take),
w4a16_dequant.py, w4a16_matmul.py (the routing by rows), gather_cols.py (x in act-order).
GGUF blocks: gguf_blocks.py (layouts), gguf_gemv.py, gguf_dequant.py, gguf_matmul.py,
gguf_q4k_mma.py (Q4_K in the int4 MMA's layout).
Shared by the dequantising paths: split_k.py (K over programs), expand_mm.py (prefill through
cuBLAS on expanded slices).
Mixture of experts: moe_topk.py (routing), moe_align.py, fused_moe.py, moe_gemv.py.
Launch machinery: pdl.py (programmatic dependent launch), compile_ahead.py (compiles side by
side in threads), _checks.py, _math.py.
"""

import os

# Floating-point contraction (a * b + c as one fused multiply-add) as every kernel here was
# written, tested and measured with: Triton 3.9 warns that its default turns it off in 3.10,
# which would change the kernels' bits and slow the dequantising ones (their inner loops are
# one multiply-add a weight). An explicit setting in the environment still wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
