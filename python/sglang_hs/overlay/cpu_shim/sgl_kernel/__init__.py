"""Import shim for `sgl_kernel` on machines without a GPU (used by `sglang-hs serve-cpu`).

SGLang's CPU mode imports these names at import time; on a CPU without AMX every layer
falls back to plain torch and none of them is ever called. Each one raises if it is, so
the shim can never silently change a result. See FORK_NOTES.md.
"""


def _never_called(name):
    def fn(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} was called, but sglang-hs' CPU shim has no kernels")

    fn.__name__ = name
    return fn


for _name in (
    "assign_draft_cache_locs_contiguous_cpu",  # imported from SGLang 0.5.23 on
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
    "gptq_gemm",  # gptq_*: imported up to SGLang 0.5.19
    "gptq_shuffle",
):
    globals()[_name] = _never_called(_name)

__version__ = "0.0.0+sglang-hs-cpu-shim"
