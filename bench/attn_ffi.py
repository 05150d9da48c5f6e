"""libattn through ctypes, for the Python benchmarks in this folder.

One copy of what the benchmarks share: attn.h's enum values, its size-tagged
structs as ctypes.Structure, `Lib` (loads libattn.so, declares the functions'
signatures, turns a failed status into AttnError with the library's message),
`Plan` (a BSHD plan over torch CUDA tensors with its workspace), and the
CUDA-event timer and relative error the tables report.

tests/ffi/test_bench_ffi.py checks every constant, struct field and declared
signature here against include/attn/attn.h, and each struct's size against
the C compiler's. Importing this module needs no torch: torch is imported
only by what touches CUDA tensors or events.
"""
import ctypes

# --- Enumerations (attn.h; values are the ABI, never renumbered) -----------

# attn_status_t
ATTN_STATUS_SUCCESS = 0
ATTN_STATUS_INVALID_ARGUMENT = 1
ATTN_STATUS_INVALID_HANDLE = 2
ATTN_STATUS_NOT_SUPPORTED = 3
ATTN_STATUS_WORKSPACE_TOO_SMALL = 4
ATTN_STATUS_OUT_OF_MEMORY = 5
ATTN_STATUS_BACKEND_UNAVAILABLE = 6
ATTN_STATUS_BACKEND_ERROR = 7
ATTN_STATUS_CAPACITY = 8
ATTN_STATUS_COMMUNICATION_ERROR = 9
ATTN_STATUS_INTERNAL_ERROR = 10

# attn_backend_t
ATTN_BACKEND_AUTO = 0
ATTN_BACKEND_CPU = 1
ATTN_BACKEND_CUDA = 2

# attn_dtype_t
ATTN_DTYPE_FP32 = 0
ATTN_DTYPE_FP16 = 1
ATTN_DTYPE_BF16 = 2

# attn_layout_t
ATTN_LAYOUT_BSHD = 0
ATTN_LAYOUT_BHSD = 1
ATTN_LAYOUT_THD = 2

# attn_mask_t
ATTN_MASK_NONE = 0
ATTN_MASK_CAUSAL = 1
ATTN_MASK_WINDOW = 2

# attn_tensor_role_t
ATTN_TENSOR_Q = 0
ATTN_TENSOR_K = 1
ATTN_TENSOR_V = 2
ATTN_TENSOR_O = 3
ATTN_TENSOR_DO = 4
ATTN_TENSOR_DQ = 5
ATTN_TENSOR_DK = 6
ATTN_TENSOR_DV = 7

# attn_passes_t (what a plan is built for)
ATTN_PASSES_FORWARD = 1
ATTN_PASSES_FORWARD_BACKWARD = 3

# attn_pass_t (one pass, for workspace sizes)
ATTN_PASS_FORWARD = 1
ATTN_PASS_BACKWARD = 2

# attn_kv_layout_t
ATTN_KV_LAYOUT_NHD = 0
ATTN_KV_LAYOUT_HND = 1

# attn_ring_layout_t
ATTN_RING_LAYOUT_CONTIGUOUS = 0
ATTN_RING_LAYOUT_ZIGZAG = 1

# --- Structs (field order and types exactly as attn.h) ---------------------

_u64, _i64, _i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
_f32, _f64 = ctypes.c_float, ctypes.c_double
_name64 = ctypes.c_char * 64


class PlanInfo(ctypes.Structure):
    """attn_plan_info_t"""
    _fields_ = [
        ("struct_size", _u64), ("backend", _i32), ("dtype", _i32), ("tile_q", _i32), ("tile_kv", _i32),
        ("num_threads", _i32), ("supports_backward", _i32), ("workspace_bytes_forward", _u64),
        ("workspace_bytes_backward", _u64), ("visible_pairs", _u64), ("flops_forward", _f64),
        ("flops_backward", _f64), ("bytes_forward", _f64), ("bytes_backward", _f64),
        ("algorithm", _name64), ("kernel", _name64),
        ("visited_tile_pairs", _u64), ("total_tile_pairs", _u64),
        ("block_q", _i32), ("block_kv", _i32),
    ]


class KvCacheConfig(ctypes.Structure):
    """attn_kv_cache_config_t"""
    _fields_ = [
        ("struct_size", _u64), ("dtype", _i32), ("layout", _i32), ("page_size", _i64),
        ("num_pages", _i64), ("heads_kv", _i64), ("head_dim_qk", _i64), ("head_dim_v", _i64),
        ("window", _i64), ("sink_tokens", _i64),
    ]


class KvCacheInfo(ctypes.Structure):
    """attn_kv_cache_info_t"""
    _fields_ = [
        ("struct_size", _u64), ("num_pages", _i64), ("pages_in_use", _i64), ("num_sequences", _i64),
        ("page_size", _i64), ("bytes_per_token", _u64), ("memory_bytes", _u64),
        ("owns_memory", _i32), ("reserved", _i32),
    ]


class DecodeConfig(ctypes.Structure):
    """attn_decode_config_t"""
    _fields_ = [
        ("struct_size", _u64), ("heads_q", _i64), ("max_batch", _i64), ("max_query_tokens", _i64),
        ("max_kv_tokens", _i64), ("kv_chunk_tokens", _i64), ("softmax_scale", _f32), ("softcap", _f32),
    ]


class DecodeStepInfo(ctypes.Structure):
    """attn_decode_step_info_t"""
    _fields_ = [
        ("struct_size", _u64), ("total_q", _i64), ("num_work_units", _i64), ("split_sequences", _i64),
        ("max_chunks", _i64), ("kv_chunk_tokens", _i64), ("visible_pairs", _u64),
        ("kv_bytes_read", _f64),
    ]


class DecodePlanInfo(ctypes.Structure):
    """attn_decode_plan_info_t"""
    _fields_ = [
        ("struct_size", _u64), ("backend", _i32), ("dtype", _i32), ("heads_q", _i64), ("heads_kv", _i64),
        ("max_batch", _i64), ("max_query_tokens", _i64), ("max_kv_tokens", _i64),
        ("kv_chunk_tokens", _i64), ("num_threads", _i32), ("reserved", _i32), ("workspace_bytes", _u64),
        ("algorithm", _name64), ("kernel", _name64),
        ("split_target_tasks", _i64), ("split_min_chunk_tokens", _i64),
    ]


class RingPlanInfo(ctypes.Structure):
    """attn_ring_plan_info_t"""
    _fields_ = [
        ("struct_size", _u64), ("layout", _i32), ("rank", _i32), ("size", _i32), ("steps", _i32),
        ("exchanges_forward", _i32), ("exchanges_backward", _i32), ("local_seqlen_q", _i64),
        ("local_seqlen_kv", _i64), ("bytes_per_step_forward", _u64), ("bytes_per_step_backward", _u64),
        ("blocks_computed", _u64), ("blocks_skipped", _u64), ("local_visible_pairs", _u64),
        ("transport", ctypes.c_char * 32),
    ]


def sized(struct_type):
    """A zeroed struct_type with struct_size set, for the size-tagged calls."""
    s = struct_type()
    s.struct_size = ctypes.sizeof(struct_type)
    return s


# --- Functions ---------------------------------------------------------------

# c_void_p stands for handles (attn_*_t) and for memory given as an address
# (torch's data_ptr(), device pointers), typed POINTERs for host arrays and
# structs. Only the functions the benchmarks call.
_vp, _sz, _P = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER
SIGNATURES = {
    "attn_status_string": ([_i32], ctypes.c_char_p),
    "attn_last_error_message": ([], ctypes.c_char_p),
    "attn_context_create": ([_i32, _i32, _i32, _P(_vp)], _i32),
    "attn_context_destroy": ([_vp], _i32),
    "attn_plan_desc_create": ([_P(_vp)], _i32),
    "attn_plan_desc_destroy": ([_vp], _i32),
    "attn_plan_desc_set_shape": ([_vp, _i64, _i64, _i64, _i64, _i64, _i64, _i64], _i32),
    "attn_plan_desc_set_dtype": ([_vp, _i32], _i32),
    "attn_plan_desc_set_layout": ([_vp, _i32], _i32),
    "attn_plan_desc_set_mask": ([_vp, _i32, _i64, _i64], _i32),
    "attn_plan_desc_set_passes": ([_vp, _i32], _i32),
    "attn_plan_desc_set_block_mask": ([_vp, _vp], _i32),
    "attn_plan_desc_set_moba": ([_vp, _i64, _i64, _i32], _i32),
    "attn_plan_desc_set_moba_keep_selection": ([_vp, _i32], _i32),
    "attn_plan_create": ([_vp, _vp, _P(_vp)], _i32),
    "attn_plan_destroy": ([_vp], _i32),
    "attn_plan_workspace_size": ([_vp, _i32, _P(_sz)], _i32),
    "attn_plan_describe": ([_vp, _P(PlanInfo)], _i32),
    # plan, q, k, v, o, lse, workspace, workspace_bytes, stream
    "attn_forward": ([_vp] * 7 + [_sz, _vp], _i32),
    # plan, q, k, v, o, lse, do, dq, dk, dv, workspace, workspace_bytes, stream
    "attn_backward": ([_vp] * 11 + [_sz, _vp], _i32),
    "attn_block_mask_create": ([_i64] * 6 + [_P(_vp)], _i32),
    "attn_block_mask_destroy": ([_vp], _i32),
    "attn_block_mask_add_window": ([_vp, _i64, _i64], _i32),
    "attn_block_mask_add_global_keys": ([_vp, _P(_i64), _i64], _i32),
    "attn_block_mask_set_blocks": ([_vp, _P(_i32), _P(_i32), _i32, _P(ctypes.c_uint8), _P(_i32),
                                    _P(_i32), _i32], _i32),
    "attn_kv_cache_create": ([_vp, _P(KvCacheConfig), _vp, _sz, _P(_vp)], _i32),
    "attn_kv_cache_destroy": ([_vp], _i32),
    "attn_kv_cache_add_sequence": ([_vp, _i64], _i32),
    "attn_kv_cache_append": ([_vp, _i32, _P(_i64), _P(_i32), _vp, _vp, _vp], _i32),
    "attn_kv_cache_get_info": ([_vp, _P(KvCacheInfo)], _i32),
    "attn_decode_plan_create": ([_vp, _vp, _P(DecodeConfig), _P(_vp)], _i32),
    "attn_decode_plan_destroy": ([_vp], _i32),
    "attn_decode_plan_workspace_size": ([_vp, _P(_sz)], _i32),
    "attn_decode_plan_describe": ([_vp, _P(DecodePlanInfo)], _i32),
    "attn_decode_prepare": ([_vp, _vp, _i32, _P(_i64), _P(_i32), _vp, _sz, _P(DecodeStepInfo), _vp], _i32),
    "attn_decode_execute": ([_vp] * 6 + [_sz, _vp], _i32),
}


class AttnError(RuntimeError):
    """A call that returned a status other than ATTN_STATUS_SUCCESS."""

    def __init__(self, status, msg):
        super().__init__(msg)
        self.status = status


class Lib:
    """libattn.so at `path`; `dll` holds the functions with SIGNATURES declared.

    A function the library lacks (one built before the function existed, as
    compare_torch.py's --lib-before may load) is left undeclared: calling it
    raises AttributeError, the others work."""

    def __init__(self, path):
        self.dll = ctypes.CDLL(path)
        for name, (args, res) in SIGNATURES.items():
            f = getattr(self.dll, name, None)
            if f is not None:
                f.argtypes, f.restype = args, res

    def check(self, status, what):
        """Raises AttnError '<what>: <status name>: <last error message>' unless status is SUCCESS."""
        if status != ATTN_STATUS_SUCCESS:
            msg = self.dll.attn_last_error_message().decode()
            name = self.dll.attn_status_string(status).decode()
            raise AttnError(status, f"{what}: {name}: {msg}")

    def context(self, backend, device=0, num_threads=0):
        """A new context handle (c_void_p); free it with attn_context_destroy."""
        ctx = _vp()
        self.check(self.dll.attn_context_create(backend, device, num_threads, ctypes.byref(ctx)), "context")
        return ctx


class Plan:
    """A BSHD plan over torch CUDA tensors [B, L, H, d] (LSE [B, H_q, L] fp32),
    run on PyTorch's current stream, with one workspace for every pass it has.

    block_mask: an attn_block_mask_t handle (the plan copies it); moba:
    (block_size, top_k, shared_per_group); keep_selection: the backward reads
    the selection the forward left in the (shared) workspace."""

    def __init__(self, lib, ctx, batch, heads_q, heads_kv, seqlen, head_dim, dtype=ATTN_DTYPE_BF16,
                 mask=ATTN_MASK_CAUSAL, passes=ATTN_PASSES_FORWARD_BACKWARD, block_mask=None, moba=None,
                 keep_selection=False):
        import torch
        self._torch = torch
        self.lib = lib
        dl = lib.dll
        desc = _vp()
        lib.check(dl.attn_plan_desc_create(ctypes.byref(desc)), "plan_desc_create")
        try:
            lib.check(dl.attn_plan_desc_set_shape(desc, batch, heads_q, heads_kv, seqlen, seqlen,
                                                  head_dim, head_dim), "set_shape")
            lib.check(dl.attn_plan_desc_set_dtype(desc, dtype), "set_dtype")
            lib.check(dl.attn_plan_desc_set_layout(desc, ATTN_LAYOUT_BSHD), "set_layout")
            lib.check(dl.attn_plan_desc_set_mask(desc, mask, -1, -1), "set_mask")
            lib.check(dl.attn_plan_desc_set_passes(desc, passes), "set_passes")
            if block_mask is not None:
                lib.check(dl.attn_plan_desc_set_block_mask(desc, block_mask), "set_block_mask")
            if moba is not None:
                block_size, top_k, shared = moba
                lib.check(dl.attn_plan_desc_set_moba(desc, block_size, top_k, 1 if shared else 0), "set_moba")
                if keep_selection:
                    lib.check(dl.attn_plan_desc_set_moba_keep_selection(desc, 1), "set_moba_keep_selection")
            self.handle = _vp()
            lib.check(dl.attn_plan_create(ctx, desc, ctypes.byref(self.handle)), "plan_create")
        finally:
            dl.attn_plan_desc_destroy(desc)
        try:
            self.info = sized(PlanInfo)
            lib.check(dl.attn_plan_describe(self.handle, ctypes.byref(self.info)), "describe")
            self.ws_bytes = 0
            has_backward = passes == ATTN_PASSES_FORWARD_BACKWARD
            for p in (ATTN_PASS_FORWARD, ATTN_PASS_BACKWARD) if has_backward else (ATTN_PASS_FORWARD,):
                n = _sz()
                lib.check(dl.attn_plan_workspace_size(self.handle, p, ctypes.byref(n)), "workspace_size")
                self.ws_bytes = max(self.ws_bytes, n.value)
            self.ws = torch.empty(max(self.ws_bytes, 1), dtype=torch.uint8, device="cuda")
        except BaseException:
            dl.attn_plan_destroy(self.handle)
            raise

    def forward(self, q, k, v, o, lse):
        s = self._torch.cuda.current_stream().cuda_stream
        self.lib.check(self.lib.dll.attn_forward(self.handle, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                 o.data_ptr(), lse.data_ptr(), self.ws.data_ptr(),
                                                 self.ws_bytes, s), "attn_forward")

    def backward(self, q, k, v, o, lse, do, dq, dk, dv):
        s = self._torch.cuda.current_stream().cuda_stream
        p = [t.data_ptr() for t in (q, k, v, o, lse, do, dq, dk, dv)]
        self.lib.check(self.lib.dll.attn_backward(self.handle, *p, self.ws.data_ptr(), self.ws_bytes, s),
                       "attn_backward")

    def close(self):
        """Destroys the plan and lets its workspace go now, not when the Plan object does."""
        self.lib.dll.attn_plan_destroy(self.handle)
        self.ws = None


# --- Measurement -------------------------------------------------------------

def time_ms(fn, warmup, reps):
    """Median (the upper one for an even reps) of reps CUDA-event timings of fn()
    on the current stream, in ms, after warmup untimed calls."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    times.sort()
    return times[len(times) // 2]


def rel_err(a, b):
    """Relative L2 difference |a - b| / |b| of two torch tensors, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
