"""The fused LM-head loss plan: CE, z-loss, entropy, distillation and GRPO terms, their metrics and
one combined gradient from one pass over the logits (see headloss.h, "Fused LM-head loss plan").

`LossPlan(vocab, dtype, ...)` validates the options once; `plan(logits, labels, ...)` runs it on
NumPy arrays (CPU backend) or PyTorch / CuPy device arrays (CUDA backend, current stream).
`fused_loss(...)` does both with a cached plan.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np
from typing import Any, NamedTuple, Optional

from ._arrays import dtype_code, empty, same_place, view
from ._lib import (BACKEND_CPU, BACKEND_CUDA, DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_I32, DTYPE_I64,
                   DTYPE_NONE, declare)
from ._lib import check as _check

c_i64, c_ptr, c_int, c_uint, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_float

TERMS = {"ce": 1, "z": 2, "entropy": 4, "distill_fwd": 8, "distill_rev": 16, "grpo": 32, "kl_ref": 64}
UNCHECKED = 1  # HL_LOSS_UNCHECKED: no checks that synchronise with the device
GRAD_MODES = {None: 0, "none": 0, "write": 1, "accumulate": 2}
SCALARS = ("loss", "ce", "z", "entropy", "distill", "grpo", "kl_ref", "divisor", "weight_sum",
           "valid_rows", "lse_mean", "entropy_mean", "logp_mean", "accuracy", "ratio_mean",
           "ratio_min", "ratio_max", "clip_low", "clip_high", "clip_any", "k3_old", "kl_ref_mean",
           "adv_mean", "adv_min", "adv_max", "distill_kl_mean")


class _Desc(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("backend", c_int), ("vocab", c_i64),
                ("logits_dtype", c_int), ("labels_dtype", c_int), ("terms", c_uint), ("flags", c_uint),
                ("ce_weight", c_float), ("z_weight", c_float), ("entropy_weight", c_float),
                ("distill_weight", c_float), ("grpo_weight", c_float), ("kl_ref_beta", c_float),
                ("label_smoothing", c_float), ("logit_scale", c_float), ("softcap", c_float),
                ("teacher_temperature", c_float), ("student_temperature", c_float),
                ("eps_low", c_float), ("eps_high", c_float), ("use_ignore_index", c_int),
                ("ignore_index", c_i64), ("grad_mode", c_int), ("grad_dtype", c_int),
                ("vocab_start", c_i64), ("vocab_global", c_i64), ("ranks", c_int)]


class _Args(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("rows", c_i64), ("logits", c_ptr),
                ("logits_stride", c_i64), ("labels", c_ptr), ("weights", c_ptr),
                ("teacher_logits", c_ptr), ("teacher_stride", c_i64), ("advantages", c_ptr),
                ("old_logprobs", c_ptr), ("ref_logprobs", c_ptr), ("divisor", ctypes.c_double),
                ("grad_scale", c_float), ("grad", c_ptr), ("grad_stride", c_i64), ("scalars", c_ptr),
                ("token_loss", c_ptr), ("token_logp", c_ptr), ("token_entropy", c_ptr),
                ("token_lse", c_ptr)]


_create = declare("hl_loss_plan_create", ctypes.POINTER(_Desc), ctypes.POINTER(c_ptr))
_ws_size = declare("hl_loss_plan_get_workspace_size", c_ptr, c_i64, ctypes.POINTER(ctypes.c_size_t))
_execute = declare("hl_loss_plan_execute", c_ptr, ctypes.POINTER(_Args), c_ptr, ctypes.c_size_t, c_ptr)
_destroy = declare("hl_loss_plan_destroy", c_ptr)
_stats_size = declare("hl_loss_plan_get_stats_size", c_ptr, c_i64, ctypes.POINTER(ctypes.c_size_t))
_stats = declare("hl_loss_plan_execute_stats", c_ptr, ctypes.POINTER(_Args), c_ptr, ctypes.c_size_t, c_ptr)
_finish = declare("hl_loss_plan_execute_finish", c_ptr, ctypes.POINTER(_Args), c_ptr, ctypes.c_size_t,
                  c_ptr, ctypes.c_size_t, c_ptr)
_nccl = declare("hl_loss_plan_execute_nccl", c_ptr, ctypes.POINTER(_Args), c_ptr, c_ptr, ctypes.c_size_t,
                c_ptr)
_ITEMSIZE = {DTYPE_F32: 4, DTYPE_F16: 2, DTYPE_BF16: 2, DTYPE_I32: 4, DTYPE_I64: 8}


class LossOutput(NamedTuple):
    scalars: Any                  # fp32 [len(SCALARS)] array on the logits' device
    grad: Optional[Any]           # the gradient, when the plan has one
    token_loss: Optional[Any] = None
    token_logp: Optional[Any] = None
    token_entropy: Optional[Any] = None
    token_lse: Optional[Any] = None

    def as_dict(self) -> dict:
        """The scalars as Python floats by name (synchronises with the device)."""
        s = self.scalars
        vals = s.tolist() if hasattr(s, "tolist") else list(s)
        return dict(zip(SCALARS, (float(v) for v in vals)))


class LossPlan:
    """A validated loss description. Options mirror hl_loss_plan_desc_t: `terms` is an iterable of
    names from TERMS (or an int of HL_LOSS_* bits); weights default to 1 for each term named.

    Tensor parallelism: with vocab_global and ranks set, the plan is the shard [vocab_start,
    vocab_start + vocab) of the vocabulary; run it with stats(), an all-gather of the blocks, and
    finish(), or with nccl() on an NCCL communicator. check=False skips the checks that
    synchronise with the GPU (labels in range, gathered headers)."""

    def __init__(self, vocab: int, dtype, *, terms=("ce",), device: str = "cpu", labels_dtype="int64",
                 ce_weight=1.0, z_weight=1.0, entropy_weight=1.0, distill_weight=1.0,
                 grpo_weight=1.0, kl_ref_beta=1.0, label_smoothing=0.0, logit_scale=0.0,
                 softcap=0.0, teacher_temperature=0.0, student_temperature=0.0, eps_low=0.0,
                 eps_high=0.0, ignore_index: Optional[int] = None, grad: Optional[str] = "write",
                 grad_dtype=None, check: bool = True, vocab_start: int = 0,
                 vocab_global: int = 0, ranks: int = 0):
        bits = terms if isinstance(terms, int) else sum(TERMS[t] for t in terms)
        d = _Desc(ctypes.sizeof(_Desc), BACKEND_CUDA if device == "cuda" else BACKEND_CPU, vocab,
                  dtype_code(dtype), DTYPE_NONE if labels_dtype is None else dtype_code(labels_dtype),
                  bits, 0 if check else UNCHECKED, ce_weight, z_weight,
                  entropy_weight, distill_weight, grpo_weight, kl_ref_beta, label_smoothing,
                  logit_scale, softcap, teacher_temperature, student_temperature, eps_low, eps_high)
        if ignore_index is not None:
            d.use_ignore_index, d.ignore_index = 1, ignore_index
        d.grad_mode = GRAD_MODES[grad]
        d.grad_dtype = DTYPE_NONE if grad_dtype is None else dtype_code(grad_dtype)
        d.vocab_start, d.vocab_global, d.ranks = vocab_start, vocab_global, ranks
        self.vocab, self.terms, self.desc = vocab, bits, d
        self._handle = c_ptr()
        _check(_create(ctypes.byref(d), ctypes.byref(self._handle)))
        self._destroy = _destroy

    def __del__(self):
        h = getattr(self, "_handle", None)
        if h is not None and h.value:
            self._destroy(h)
            self._handle = None

    @property
    def grad_mode(self) -> int:
        return self.desc.grad_mode

    def workspace_bytes(self, rows: int) -> int:
        n = ctypes.c_size_t(0)
        _check(_ws_size(self._handle, rows, ctypes.byref(n)))
        return n.value

    def __call__(self, logits, labels=None, *, weights=None, teacher_logits=None, advantages=None,
                 old_logprobs=None, ref_logprobs=None, divisor: float = 0.0, grad_scale: float = 0.0,
                 grad=None, token_outputs: bool = False, in_place: bool = False,
                 scalars=None, tokens=None) -> LossOutput:
        """Runs the plan. grad: an existing gradient (written, or accumulated into with
        grad='accumulate'); in_place writes the gradient over the logits. scalars / tokens
        (4 arrays: loss, logp, entropy, lse): optional preallocated fp32 outputs."""
        a, lv, out = self._args(logits, labels, weights, teacher_logits, advantages, old_logprobs,
                                ref_logprobs, divisor, grad_scale, grad, token_outputs, in_place,
                                scalars, tokens)
        ws, wp, nbytes = self._workspace(lv, a.rows)
        _check(_execute(self._handle, ctypes.byref(a), wp, nbytes, lv.stream))
        return out

    def _workspace(self, lv, rows):
        """(array, pointer, bytes) of a fresh workspace on lv's device (None, None, 0 if none)."""
        nbytes = self.workspace_bytes(rows)
        if not nbytes:
            return None, None, 0
        ws = empty(lv, ((nbytes + 15) // 16 * 4,), DTYPE_F32)
        return ws, view(ws, "workspace").ptr, nbytes

    def stats_bytes(self, rows: int) -> int:
        """Bytes of one rank's block of statistics for `rows` rows."""
        n = ctypes.c_size_t(0)
        _check(_stats_size(self._handle, rows, ctypes.byref(n)))
        return n.value

    def stats(self, logits, labels=None, *, teacher_logits=None):
        """Step 1 of the sharded loss: this rank's block of per-row statistics, an int64 array on
        the logits' device, to all-gather across the ranks (torch.distributed.all_gather_into_tensor,
        cupy / NCCL, ...)."""
        a, lv, _ = self._args(logits, labels, None, teacher_logits, None, None, None, 0.0, 0.0,
                              None, False, False, None, None, outputs=False)
        block = empty(lv, (self.stats_bytes(a.rows) // 8,), DTYPE_I64)
        _check(_stats(self._handle, ctypes.byref(a), view(block, "stats").ptr, self.stats_bytes(a.rows),
                     lv.stream))
        return block

    def finish(self, gathered, logits, labels=None, **kwargs) -> LossOutput:
        """Step 3: merges the gathered blocks (every rank's stats(), concatenated) and returns the
        scalars and per-token outputs (identical on every rank) and this shard's gradient.
        Keyword arguments as for calling the plan."""
        a, lv, out = self._call_args(logits, labels, kwargs)
        gv = view(gathered, "gathered")
        if gv.strides != tuple(int(np.prod(gv.shape[i + 1:])) for i in range(len(gv.shape))):
            raise ValueError("gathered must be contiguous")
        gbytes = int(np.prod(gv.shape)) * _ITEMSIZE.get(gv.dtype, 0)
        ws, wp, nbytes = self._workspace(lv, a.rows)
        _check(_finish(self._handle, ctypes.byref(a), gv.ptr, gbytes, wp, nbytes, lv.stream))
        return out

    def nccl(self, comm, logits, labels=None, **kwargs) -> LossOutput:
        """The three steps on an NCCL communicator of `ranks` ranks (an ncclComm_t as an int, e.g.
        cupy.cuda.nccl.NcclCommunicator.ptr), on the logits' current stream. Every rank calls it."""
        a, lv, out = self._call_args(logits, labels, kwargs)
        ws, wp, nbytes = self._workspace(lv, a.rows)
        _check(_nccl(self._handle, ctypes.byref(a), int(comm), wp, nbytes, lv.stream))
        return out

    def _call_args(self, logits, labels, kwargs):
        kwargs = dict(kwargs)  # the caller's keeps its arrays alive through the call (bare pointers)
        names = ("weights", "teacher_logits", "advantages", "old_logprobs", "ref_logprobs")
        opt = {k: kwargs.pop(k, None) for k in names}
        rest = (kwargs.pop("divisor", 0.0), kwargs.pop("grad_scale", 0.0), kwargs.pop("grad", None),
                kwargs.pop("token_outputs", False), kwargs.pop("in_place", False),
                kwargs.pop("scalars", None), kwargs.pop("tokens", None))
        if kwargs:
            raise TypeError(f"unexpected arguments: {sorted(kwargs)}")
        return self._args(logits, labels, *opt.values(), *rest)

    def _args(self, logits, labels, weights, teacher_logits, advantages, old_logprobs, ref_logprobs,
              divisor, grad_scale, grad, token_outputs, in_place, scalars, tokens, outputs=True):
        """The hl_loss_args_t of one call, its logits' view and the LossOutput it fills (outputs
        allocated here unless passed; none for the statistics step)."""
        lv = view(logits, "logits")
        rows, cols, ls = lv.rows_view("logits")
        if cols != self.vocab:
            raise ValueError(f"logits have {cols} columns; the plan's vocab is {self.vocab}")
        opt = {k: (None if x is None else view(x, k)) for k, x in
               (("labels", labels), ("weights", weights), ("teacher_logits", teacher_logits),
                ("advantages", advantages), ("old_logprobs", old_logprobs),
                ("ref_logprobs", ref_logprobs))}
        same_place([lv] + [v for v in opt.values()], "loss plan")
        a = _Args(ctypes.sizeof(_Args), rows, lv.ptr, ls)
        for k, v in opt.items():
            if v is not None:
                setattr(a, k, v.ptr)
        if opt["teacher_logits"] is not None:
            a.teacher_stride = opt["teacher_logits"].rows_view("teacher_logits")[2]
        a.divisor, a.grad_scale = divisor, grad_scale
        if not outputs:
            return a, lv, None
        if self.grad_mode:
            if in_place:
                grad = logits
            elif grad is None:
                gdt = self.desc.grad_dtype or lv.dtype
                grad = empty(lv, lv.shape, gdt)
            gv = view(grad, "grad")
            a.grad, a.grad_stride = gv.ptr, gv.rows_view("grad")[2]
        if scalars is None:
            scalars = empty(lv, (len(SCALARS),), DTYPE_F32)
        a.scalars = view(scalars, "scalars").ptr
        toks = list(tokens) if tokens is not None else [None] * 4
        if token_outputs and tokens is None:
            toks = [empty(lv, lv.shape[:-1], DTYPE_F32) for _ in range(4)]
        if toks[0] is not None:
            a.token_loss, a.token_logp, a.token_entropy, a.token_lse = (view(t, "token").ptr for t in toks)
        return a, lv, LossOutput(scalars, grad if self.grad_mode else None, *toks)


@lru_cache(maxsize=64)
def _cached_plan(vocab, dtype, device, key):
    return LossPlan(vocab, dtype, device=device, **dict(key))


def fused_loss(logits, labels=None, *, terms=("ce",), weights=None, teacher_logits=None,
               advantages=None, old_logprobs=None, ref_logprobs=None, divisor: float = 0.0,
               grad_scale: float = 0.0, token_outputs: bool = False, grad: Optional[str] = "write",
               **options) -> LossOutput:
    """One call: builds (and caches) the plan for these options and runs it. Returns the scalars
    (see SCALARS and LossOutput.as_dict), the gradient and, on request, per-token outputs."""
    lv = view(logits, "logits")
    device = "cuda" if lv.backend == BACKEND_CUDA else "cpu"
    ldt = None if labels is None else view(labels, "labels").dtype
    key = dict(options, terms=tuple(terms) if not isinstance(terms, int) else terms, grad=grad,
               labels_dtype={None: None, DTYPE_I32: "int32", DTYPE_I64: "int64"}[ldt])
    plan = _cached_plan(lv.shape[-1], lv.dtype, device, tuple(sorted(key.items())))
    return plan(logits, labels, weights=weights, teacher_logits=teacher_logits,
                advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                divisor=divisor, grad_scale=grad_scale, token_outputs=token_outputs)
