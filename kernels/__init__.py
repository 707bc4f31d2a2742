"""Triton kernels, one op per file.

Each file holds a private `@triton.jit` kernel, a public launcher with keyword arguments that
checks shapes, dtypes and strides (kernels/_checks.py), and its torch twin `<launcher>_ref`
beside it. Launchers take CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (tests).

    store_kv.py          store_kv                  new K/V into the pool at their slots
    fp8_kv.py            quantize_kv               fp8 formats and the saturating cast (torch)
    fp8_weights.py       quantize_rows/_blocks     fp8 weight layouts and their scales (torch)
    fp8_act_quant.py     quantize_act              activations to fp8 per token / 128 columns
    fp8_gemv.py          fp8_gemv                  decode's skinny matmul over fp8 weights
    fp8_block_gemm.py    fp8_block_gemm            w8a8 GEMM with 128x128 block weight scales
    extend_attention.py  extend_attention          prefill over cached prefix + new tokens
    decode_attention.py  decode_attention          split-K decode over the slot table
    rmsnorm.py           rmsnorm                   RMSNorm, optionally fused with the residual add
    rotary.py            apply_rotary              neox RoPE in place; build_cos_sin_cache
    silu_mul.py          silu_mul                  silu(gate) * up
    bitmask.py           apply_token_bitmask       grammar bitmask onto logits
    w4a16.py             w4a16_ref                 the int4 weight layout, packing, torch twin
    w4a16_gemv.py        w4a16_gemv                int4-weight matmul for decode (<= MAX_M rows)
    w4a16_gemm.py        w4a16_gemm                int4-weight matmul, 5 to 32 rows (tensor cores)

Not a kernel: compile_ahead.py runs launches once in threads, so that their compiles overlap.
"""
