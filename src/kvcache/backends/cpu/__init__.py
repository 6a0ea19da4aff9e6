"""The CPU decode steps and what they run on: `float32_step` (float32 weights packed once) and
`half_step` (bfloat16/float16 read in place), both on `cpu_backend`; `paged_step`, the engine's
step over a `PagedBatch`; numba's compiled kernels (`numba_kernels`, `numba_values`, called through
`numba_products`); oneDNN's products for prompts and batches (`onednn`, `prompt_products`,
`float16_products`); the packed weights (`packing`) on 2 MB pages (`huge_pages`); torch's thread
count (`threads`); which models they stand in for (`support`). Their reasons and measurements:
docs/backends.md.
"""
