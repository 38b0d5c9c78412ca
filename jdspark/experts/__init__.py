"""The host expert pool: routed experts that do not fit the GPU, served from host memory.

- `banks`: `ExpertBank`, a layer's experts in their packed checkpoint storage (ds_fp4 / FP8 / bf16),
  contiguous per expert, page-aligned (huge pages where the kernel allows).
- `cpu_gemv`: `moe_forward(bank, x, ids, weights)`, the multi-threaded CPU routed-expert forward
  (C++ kernel built at first use; `numba_gemv` is the measured alternative), and `host_callback`,
  its form for one `jax.pure_callback` per MoE layer.
- `host_ffi`: the same forward as an XLA FFI custom call (`jds_host_experts`): on the GPU it is
  enqueued on the stream (device-to-pinned copy, host function, copy back) instead of blocking a
  thread, and its programs can be serialized. `hybrid` uses it by default.
- `placement`: `plan_placement(sizes, gpu_budget, counts)`, which (layer, expert) live on the GPU,
  and its start-up report.
- `bench_bw`: `jdspark bench bw`, the bandwidths the split is decided from.
"""
