#!/usr/bin/env python3
"""libattn from Python through ctypes: no compiled extension, just the C API.

Usage:  python3 attn_numpy.py [path/to/libattn.so]
        (else $LIBATTN, else ctypes.util.find_library("attn"))

It builds a CPU context and a causal GQA plan (8 query heads on 2 key/value
heads, BSHD layout), sizes the workspaces, runs the forward and backward
passes on numpy arrays in fp32 and fp16, and checks O, LSE, dQ, dK and dV
against a float64 numpy implementation of attention. Every call's status is
checked (a failure raises AttnError with attn_status_string() and
attn_last_error_message()). Exit 0 when everything matches, 1 otherwise,
77 when numpy is not installed.
"""
import ctypes
import ctypes.util
import os
import sys

try:
    import numpy as np
except ImportError:  # pragma: no cover
    print("SKIP: numpy is not installed")
    sys.exit(77)

# ---------------------------------------------------------------------------
# The C API: constants, types, prototypes (mirrors include/attn/attn.h)
# ---------------------------------------------------------------------------

ATTN_STATUS_SUCCESS = 0
ATTN_BACKEND_CPU = 1
ATTN_DTYPE_FP32, ATTN_DTYPE_FP16, ATTN_DTYPE_BF16 = 0, 1, 2
ATTN_LAYOUT_BSHD = 0
ATTN_MASK_NONE, ATTN_MASK_CAUSAL, ATTN_MASK_WINDOW = 0, 1, 2
ATTN_PASSES_FORWARD_BACKWARD = 3
ATTN_PASS_FORWARD, ATTN_PASS_BACKWARD = 1, 2

c_status = ctypes.c_int  # attn_status_t (a C enum)
c_enum = ctypes.c_int
c_handle = ctypes.c_void_p  # every opaque handle
c_handle_p = ctypes.POINTER(ctypes.c_void_p)
c_float_p = ctypes.POINTER(ctypes.c_float)
i32, i64, size_t = ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t
vp = ctypes.c_void_p


class PlanInfo(ctypes.Structure):
    """attn_plan_info_t (size-tagged: set struct_size before the call)."""
    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("backend", i32), ("dtype", i32), ("tile_q", i32), ("tile_kv", i32),
        ("num_threads", i32), ("supports_backward", i32),
        ("workspace_bytes_forward", ctypes.c_uint64),
        ("workspace_bytes_backward", ctypes.c_uint64),
        ("visible_pairs", ctypes.c_uint64),
        ("flops_forward", ctypes.c_double), ("flops_backward", ctypes.c_double),
        ("bytes_forward", ctypes.c_double), ("bytes_backward", ctypes.c_double),
        ("algorithm", ctypes.c_char * 64), ("kernel", ctypes.c_char * 64),
    ]


# name: (argtypes); every one of these returns attn_status_t.
STATUS_FUNCTIONS = {
    "attn_context_create": (c_enum, i32, i32, c_handle_p),
    "attn_context_destroy": (c_handle,),
    "attn_context_get_num_threads": (c_handle, ctypes.POINTER(i32)),
    "attn_plan_desc_create": (c_handle_p,),
    "attn_plan_desc_destroy": (c_handle,),
    "attn_plan_desc_set_shape": (c_handle, i64, i64, i64, i64, i64, i64, i64),
    "attn_plan_desc_set_dtype": (c_handle, c_enum),
    "attn_plan_desc_set_layout": (c_handle, c_enum),
    "attn_plan_desc_set_mask": (c_handle, c_enum, i64, i64),
    "attn_plan_desc_set_softmax_scale": (c_handle, ctypes.c_float),
    "attn_plan_desc_set_passes": (c_handle, c_enum),
    "attn_plan_create": (c_handle, c_handle, c_handle_p),
    "attn_plan_destroy": (c_handle,),
    "attn_plan_workspace_size": (c_handle, c_enum, ctypes.POINTER(size_t)),
    "attn_plan_describe": (c_handle, ctypes.POINTER(PlanInfo)),
    "attn_plan_summary": (c_handle, ctypes.c_char_p, size_t, ctypes.POINTER(size_t)),
    # plan, q, k, v, o, lse, workspace, workspace_bytes, stream
    "attn_forward": (c_handle, vp, vp, vp, vp, c_float_p, vp, size_t, vp),
    # plan, q, k, v, o, lse, d_o, dq, dk, dv, workspace, workspace_bytes, stream
    "attn_backward": (c_handle, vp, vp, vp, vp, c_float_p, vp, vp, vp, vp, vp, size_t, vp),
}


class AttnError(RuntimeError):
    def __init__(self, func, status, status_name, message):
        super().__init__(f"{func} failed: {status_name}: {message}")
        self.func, self.status, self.status_name, self.message = func, status, status_name, message


class Attn:
    """The loaded library with typed, status-checked functions."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        lib = self.lib
        lib.attn_version_number.argtypes, lib.attn_version_number.restype = [], ctypes.c_uint32
        lib.attn_version_string.argtypes, lib.attn_version_string.restype = [], ctypes.c_char_p
        lib.attn_status_string.argtypes, lib.attn_status_string.restype = [c_status], ctypes.c_char_p
        lib.attn_last_error_message.argtypes = []
        lib.attn_last_error_message.restype = ctypes.c_char_p
        for name, argtypes in STATUS_FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.argtypes = list(argtypes)
            fn.restype = c_status
            fn.errcheck = self._check  # runs on the calling thread, right after the call
            setattr(self, name[len("attn_"):], fn)

    def _check(self, status, func, args):
        if status != ATTN_STATUS_SUCCESS:
            # Read the thread-local message before any other libattn call.
            message = self.lib.attn_last_error_message().decode()
            raise AttnError(func.__name__, status, self.status_string(status), message)
        return status

    def status_string(self, status):
        return self.lib.attn_status_string(status).decode()

    def version(self):
        return self.lib.attn_version_number(), self.lib.attn_version_string().decode()


def load_library(argv):
    path = argv[1] if len(argv) > 1 else os.environ.get("LIBATTN") or ctypes.util.find_library("attn")
    if not path:
        sys.exit("libattn not found: pass its path as the first argument or set LIBATTN")
    if os.sep in path:
        path = os.path.abspath(path)  # a file, not a name for the loader to search
    return Attn(path)


def ptr(a):
    """The data pointer of a C-contiguous numpy array, as void*."""
    assert a.flags["C_CONTIGUOUS"]
    return a.ctypes.data_as(ctypes.c_void_p)


def fptr(a):
    assert a.dtype == np.float32 and a.flags["C_CONTIGUOUS"]
    return a.ctypes.data_as(c_float_p)


# ---------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------

def reference(q, k, v, d_o, scale, causal):
    """Attention on BSHD arrays in float64. Returns O (BSHD), LSE [B, Hq, Lq],
    dQ, dK, dV (BSHD). Causal is bottom-right aligned (query i sees key j when
    j <= i + Lk - Lq)."""
    q, k, v, d_o = (x.astype(np.float64) for x in (q, k, v, d_o))
    _, lq, hq, _ = q.shape
    _, lk, hkv, _ = k.shape
    g = hq // hkv
    qh = q.transpose(0, 2, 1, 3)                                # [B, Hq, Lq, D]
    kh = np.repeat(k.transpose(0, 2, 1, 3), g, axis=1)          # query head h uses kv head h // g
    vh = np.repeat(v.transpose(0, 2, 1, 3), g, axis=1)
    doh = d_o.transpose(0, 2, 1, 3)

    s = scale * qh @ kh.transpose(0, 1, 3, 2)                   # [B, Hq, Lq, Lk]
    if causal:
        visible = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq)
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    denom = e.sum(axis=-1, keepdims=True)
    p = e / denom
    lse = (m + np.log(denom))[..., 0]
    oh = p @ vh

    dvh = p.transpose(0, 1, 3, 2) @ doh                          # per query head
    dp = doh @ vh.transpose(0, 1, 3, 2)
    ds = p * (dp - (doh * oh).sum(axis=-1, keepdims=True))
    dqh = scale * ds @ kh
    dkh = scale * ds.transpose(0, 1, 3, 2) @ qh

    def group_sum(x):                                           # [B, Hq, L, D] -> [B, Hkv, L, D]
        b, _, length, d = x.shape
        return x.reshape(b, hkv, g, length, d).sum(axis=2)

    bshd = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    return bshd(oh), lse, bshd(dqh), bshd(group_sum(dkh)), bshd(group_sum(dvh))


def rel_err(x, ref):
    """max |x - ref| / max |ref|"""
    x = x.astype(np.float64)
    return float(np.max(np.abs(x - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


# ---------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------

def run(attn, ctx, dtype_np, dtype_attn, tol, rng):
    batch, heads_q, heads_kv, seq_q, seq_kv, dim = 2, 8, 2, 100, 130, 64
    scale = 1.0 / np.sqrt(dim)

    q = rng.uniform(-1, 1, (batch, seq_q, heads_q, dim)).astype(dtype_np)
    k = rng.uniform(-1, 1, (batch, seq_kv, heads_kv, dim)).astype(dtype_np)
    v = rng.uniform(-1, 1, (batch, seq_kv, heads_kv, dim)).astype(dtype_np)
    d_o = rng.uniform(-1, 1, (batch, seq_q, heads_q, dim)).astype(dtype_np)
    o = np.empty_like(q)
    lse = np.empty((batch, heads_q, seq_q), np.float32)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)

    desc, plan = ctypes.c_void_p(), ctypes.c_void_p()
    attn.plan_desc_create(ctypes.byref(desc))
    try:
        attn.plan_desc_set_shape(desc, batch, heads_q, heads_kv, seq_q, seq_kv, dim, dim)
        attn.plan_desc_set_dtype(desc, dtype_attn)
        attn.plan_desc_set_layout(desc, ATTN_LAYOUT_BSHD)
        attn.plan_desc_set_mask(desc, ATTN_MASK_CAUSAL, -1, -1)
        attn.plan_desc_set_softmax_scale(desc, float(scale))
        attn.plan_desc_set_passes(desc, ATTN_PASSES_FORWARD_BACKWARD)
        attn.plan_create(ctx, desc, ctypes.byref(plan))
    finally:
        attn.plan_desc_destroy(desc)  # the plan copied what it needs

    try:
        fwd_bytes, bwd_bytes = size_t(0), size_t(0)
        attn.plan_workspace_size(plan, ATTN_PASS_FORWARD, ctypes.byref(fwd_bytes))
        attn.plan_workspace_size(plan, ATTN_PASS_BACKWARD, ctypes.byref(bwd_bytes))
        ws_f = np.empty(max(fwd_bytes.value, 1), np.uint8)
        ws_b = np.empty(max(bwd_bytes.value, 1), np.uint8)

        needed = size_t(0)
        attn.plan_summary(plan, None, 0, ctypes.byref(needed))
        line = ctypes.create_string_buffer(needed.value)
        attn.plan_summary(plan, line, needed.value, None)
        info = PlanInfo(struct_size=ctypes.sizeof(PlanInfo))
        attn.plan_describe(plan, ctypes.byref(info))

        attn.forward(plan, ptr(q), ptr(k), ptr(v), ptr(o), fptr(lse), ptr(ws_f), fwd_bytes.value, None)
        attn.backward(plan, ptr(q), ptr(k), ptr(v), ptr(o), fptr(lse), ptr(d_o), ptr(dq), ptr(dk), ptr(dv),
                      ptr(ws_b), bwd_bytes.value, None)
    finally:
        attn.plan_destroy(plan)

    ref = reference(q, k, v, d_o, scale, causal=True)
    errors = {
        "O": rel_err(o, ref[0]),
        "LSE": float(np.max(np.abs(lse.astype(np.float64) - ref[1]))),  # absolute
        "dQ": rel_err(dq, ref[2]),
        "dK": rel_err(dk, ref[3]),
        "dV": rel_err(dv, ref[4]),
    }
    name = np.dtype(dtype_np).name
    print(f"[{name}] kernel={info.kernel.decode()} workspace fwd/bwd={fwd_bytes.value}/{bwd_bytes.value} B "
          f"pairs={info.visible_pairs}")
    print(f"[{name}] plan: {line.value.decode()}")
    ok = True
    for key, err in errors.items():
        good = np.isfinite(err) and err <= tol[key]
        ok &= bool(good)
        print(f"[{name}]   {key:<3} error {err:.2e} (tolerance {tol[key]:.0e}) {'ok' if good else 'FAIL'}")
    return ok


def main(argv):
    attn = load_library(argv)
    number, text = attn.version()
    print(f"libattn {text} ({number})")

    ctx = ctypes.c_void_p()
    attn.context_create(ATTN_BACKEND_CPU, 0, 0, ctypes.byref(ctx))
    try:
        threads = i32(0)
        attn.context_get_num_threads(ctx, ctypes.byref(threads))
        print(f"CPU context, {threads.value} threads per execution")

        # Errors come back as exceptions carrying the library's message.
        desc = ctypes.c_void_p()
        attn.plan_desc_create(ctypes.byref(desc))
        try:
            attn.plan_desc_set_shape(desc, 1, 0, 1, 4, 4, 8, 8)
            print("expected attn_plan_desc_set_shape to reject heads_q = 0")
            return 1
        except AttnError as e:
            print(f"error path: {e}")
            if e.status_name != "ATTN_STATUS_INVALID_ARGUMENT" or "heads_q" not in e.message:
                print("unexpected error report")
                return 1
        finally:
            attn.plan_desc_destroy(desc)

        rng = np.random.default_rng(2024)
        # Relative errors (max |x - ref| / max |ref|); LSE absolute. fp16
        # rounds the inputs (the reference uses the same rounded values) and
        # the outputs, and the backward reads the rounded O.
        ok = run(attn, ctx, np.float32, ATTN_DTYPE_FP32,
                 {"O": 1e-5, "LSE": 1e-5, "dQ": 1e-4, "dK": 1e-4, "dV": 1e-4}, rng)
        ok &= run(attn, ctx, np.float16, ATTN_DTYPE_FP16,
                  {"O": 2e-3, "LSE": 1e-4, "dQ": 3e-3, "dK": 3e-3, "dV": 3e-3}, rng)
    finally:
        attn.context_destroy(ctx)

    print("all checks passed" if ok else "MISMATCH against the float64 reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
