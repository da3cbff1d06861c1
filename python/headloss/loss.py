"""The fused LM-head loss plan: CE, z-loss, entropy, distillation and GRPO terms, their metrics and
one combined gradient from one pass over the logits (see headloss.h, "Fused LM-head loss plan").

`LossPlan(vocab, dtype, ...)` validates the options once; `plan(logits, labels, ...)` runs it on
NumPy arrays (CPU backend) or PyTorch / CuPy device arrays (CUDA backend, current stream).
`fused_loss(...)` does both with a cached plan. `LinearLossPlan(vocab, hidden, dtype, ...)` is the
fused linear form: `plan(hidden, weight, labels, ...)`, the logits never whole in memory.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np
from typing import Any, NamedTuple, Optional

from ._arrays import DTYPE_NAMES, dtype_code, empty, same_place, view
from ._lib import (BACKEND_CPU, BACKEND_CUDA, DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_I32, DTYPE_I64,
                   DTYPE_NONE, declare)
from ._lib import check as _check

c_i64, c_ptr, c_int, c_uint, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_float

TERMS = {"ce": 1, "z": 2, "entropy": 4, "distill_fwd": 8, "distill_rev": 16, "grpo": 32, "kl_ref": 64,
         "cispo": 128, "distill_jsd": 256}
KL_ESTIMATORS = {"k3": 0, "k1": 1, "k2": 2}  # HL_LOSS_KL_*: kl_estimator by name (or the int)
LEVELS = {"token": 0, "seq_product": 1, "seq_mean": 2}  # HL_LOSS_LEVEL_*: ratio_level, rollout_level
ROLLOUT_CORRECTIONS = {None: 0, "none": 0, "tis": 1, "mis": 2, "reject": 3}  # HL_LOSS_ROLLOUT_*
UNCHECKED = 1  # HL_LOSS_UNCHECKED: no checks that synchronise with the device
GRAD_MODES = {None: 0, "none": 0, "write": 1, "accumulate": 2}
SCALARS = ("loss", "ce", "z", "entropy", "distill", "grpo", "kl_ref", "divisor", "weight_sum",
           "valid_rows", "lse_mean", "entropy_mean", "logp_mean", "accuracy", "ratio_mean",
           "ratio_min", "ratio_max", "clip_low", "clip_high", "clip_any", "k3_old", "kl_ref_mean",
           "adv_mean", "adv_min", "adv_max", "distill_kl_mean", "cispo", "dual_clip",
           "rollout_kl_k1", "rollout_kl_k3", "rollout_weight_mean", "rollout_corrected", "topk_mass")
# The optional per-row inputs of a call, by keyword (cu_seqlens: [sequences + 1]; a sparse
# teacher's ids and log-probs: [rows, teacher_topk]).
INPUTS = ("weights", "teacher_logits", "advantages", "old_logprobs", "ref_logprobs",
          "rollout_logprobs", "cu_seqlens", "teacher_topk_ids", "teacher_topk_logprobs")


class _Desc(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("backend", c_int), ("vocab", c_i64),
                ("logits_dtype", c_int), ("labels_dtype", c_int), ("terms", c_uint), ("flags", c_uint),
                ("ce_weight", c_float), ("z_weight", c_float), ("entropy_weight", c_float),
                ("distill_weight", c_float), ("grpo_weight", c_float), ("kl_ref_beta", c_float),
                ("label_smoothing", c_float), ("logit_scale", c_float), ("softcap", c_float),
                ("teacher_temperature", c_float), ("student_temperature", c_float),
                ("eps_low", c_float), ("eps_high", c_float), ("use_ignore_index", c_int),
                ("ignore_index", c_i64), ("grad_mode", c_int), ("grad_dtype", c_int),
                ("vocab_start", c_i64), ("vocab_global", c_i64), ("ranks", c_int),
                ("hidden", c_i64), ("weight_dtype", c_int), ("teacher_hidden", c_i64),
                ("grad_hidden_mode", c_int), ("grad_hidden_dtype", c_int),
                ("grad_weight_mode", c_int), ("grad_weight_dtype", c_int),
                ("dual_clip", c_float), ("cispo_weight", c_float), ("cispo_eps_high", c_float),
                ("kl_estimator", c_int), ("cu_seqlens_dtype", c_int), ("ratio_level", c_int),
                ("rollout_correction", c_int), ("rollout_level", c_int), ("rollout_cap", c_float),
                ("rollout_floor", c_float), ("jsd_beta", c_float), ("teacher_topk", c_int),
                ("teacher_topk_ids_dtype", c_int)]


class _Args(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("rows", c_i64), ("logits", c_ptr),
                ("logits_stride", c_i64), ("labels", c_ptr), ("weights", c_ptr),
                ("teacher_logits", c_ptr), ("teacher_stride", c_i64), ("advantages", c_ptr),
                ("old_logprobs", c_ptr), ("ref_logprobs", c_ptr), ("divisor", ctypes.c_double),
                ("grad_scale", c_float), ("grad", c_ptr), ("grad_stride", c_i64), ("scalars", c_ptr),
                ("token_loss", c_ptr), ("token_logp", c_ptr), ("token_entropy", c_ptr),
                ("token_lse", c_ptr), ("hidden", c_ptr), ("hidden_stride", c_i64), ("weight", c_ptr),
                ("weight_stride", c_i64), ("teacher_hidden", c_ptr), ("teacher_hidden_stride", c_i64),
                ("teacher_weight", c_ptr), ("teacher_weight_stride", c_i64), ("grad_hidden", c_ptr),
                ("grad_hidden_stride", c_i64), ("grad_weight", c_ptr), ("grad_weight_stride", c_i64),
                ("cu_seqlens", c_ptr), ("num_seqs", c_i64), ("rollout_logprobs", c_ptr),
                ("teacher_topk_ids", c_ptr), ("teacher_topk_ids_stride", c_i64),
                ("teacher_topk_logprobs", c_ptr), ("teacher_topk_logprobs_stride", c_i64)]


_create = declare("hl_loss_plan_create", ctypes.POINTER(_Desc), ctypes.POINTER(c_ptr))
_ws_size = declare("hl_loss_plan_get_workspace_size", c_ptr, c_i64, ctypes.POINTER(ctypes.c_size_t))
_ws_sizes = declare("hl_loss_plan_get_workspace_sizes", c_ptr, c_i64, ctypes.POINTER(ctypes.c_size_t),
                    ctypes.POINTER(ctypes.c_size_t))
_execute = declare("hl_loss_plan_execute", c_ptr, ctypes.POINTER(_Args), c_ptr, ctypes.c_size_t, c_ptr)
_destroy = declare("hl_loss_plan_destroy", c_ptr)
_stats_size = declare("hl_loss_plan_get_stats_size", c_ptr, c_i64, ctypes.POINTER(ctypes.c_size_t))
_stats = declare("hl_loss_plan_execute_stats_ws", c_ptr, ctypes.POINTER(_Args), c_ptr, ctypes.c_size_t,
                 c_ptr, ctypes.c_size_t, c_ptr)
_finish = declare("hl_loss_plan_execute_finish", c_ptr, ctypes.POINTER(_Args), c_ptr, ctypes.c_size_t,
                  c_ptr, ctypes.c_size_t, c_ptr)
_exchanges = declare("hl_loss_plan_get_exchanges", c_ptr, ctypes.POINTER(ctypes.c_int))
_middle_size = declare("hl_loss_plan_get_middle_size", c_ptr, c_i64, ctypes.POINTER(ctypes.c_size_t))
_middle = declare("hl_loss_plan_execute_middle", c_ptr, ctypes.POINTER(_Args), c_ptr, ctypes.c_size_t,
                  c_ptr, ctypes.c_size_t, c_ptr, ctypes.c_size_t, c_ptr)
_finish_with_middle = declare("hl_loss_plan_execute_finish_with_middle", c_ptr, ctypes.POINTER(_Args), c_ptr,
                              ctypes.c_size_t, c_ptr, ctypes.c_size_t, c_ptr, ctypes.c_size_t, c_ptr)
_nccl = declare("hl_loss_plan_execute_nccl", c_ptr, ctypes.POINTER(_Args), c_ptr, c_ptr, ctypes.c_size_t,
                c_ptr)
_ITEMSIZE = {DTYPE_F32: 4, DTYPE_F16: 2, DTYPE_BF16: 2, DTYPE_I32: 4, DTYPE_I64: 8}


_PER_ROW_F32 = ("weights", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs", "scalars",
                "token")


def _packed(v) -> bool:
    acc = 1
    for n, s in reversed(list(zip(v.shape, v.strides))):
        if n == 0:
            return True
        if n != 1 and s != acc:
            return False
        acc *= n
    return True


def _check_arrays(views, expected=None) -> None:
    """TypeError for an array whose dtype is not the one the plan reads it as, ValueError for a
    per-row array that is not packed: the library gets bare pointers (and no stride for per-row
    arrays), so either would be misread (or overrun). views: (name, view) pairs; expected:
    name -> hl_dtype_t; the per-row fp32 inputs and outputs are always checked."""
    expected = expected or {}
    for name, v in views:
        if v is None:
            continue
        want = expected.get(name, DTYPE_F32 if name in _PER_ROW_F32 else DTYPE_NONE)
        if want != DTYPE_NONE and v.dtype != want:
            raise TypeError(f"{name} is {DTYPE_NAMES[v.dtype]}; the plan expects {DTYPE_NAMES[want]}")
        if (name in _PER_ROW_F32 or name in ("labels", "cu_seqlens")) and not _packed(v):
            raise ValueError(f"{name} (shape {v.shape}, strides {v.strides}) must be contiguous")


def code_of(table, what, name) -> int:
    """The code of a name in table; an int passes through (the library checks it)."""
    if isinstance(name, str) or name is None:
        if name not in table:
            raise ValueError(f"{what} {name!r}; expected one of {sorted(k for k in table if k)}")
        return table[name]
    return int(name)


def kl_estimator_code(name) -> int:
    """HL_LOSS_KL_* of a KL_ESTIMATORS name (or the int)."""
    return code_of(KL_ESTIMATORS, "kl_estimator", name)


def _set_inputs(a, views, d) -> None:
    """The optional per-row inputs' pointers (and num_seqs) into the hl_loss_args_t a."""
    for k, v in views.items():
        if v is not None:
            setattr(a, k, v.ptr)
    if views.get("cu_seqlens") is not None:
        a.num_seqs = max(int(views["cu_seqlens"].shape[0]) - 1, 0)


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
    kl_estimator: a name of KL_ESTIMATORS (or its int); dual_clip, cispo_eps_high: 0 is the default.
    Sequence-level options (calls pass cu_seqlens): ratio_level="seq_mean" is GSPO; a
    rollout_correction ("tis", "mis", "reject"; calls pass rollout_logprobs) at rollout_level
    "token", "seq_product" or "seq_mean", with rollout_cap / rollout_floor (0: 2 and 1 / cap).
    cu_seqlens_dtype: the calls' cu_seqlens dtype (default "int32" where an option is
    sequence-level, as flash-attn's).
    jsd_beta: DISTILL_JSD's beta ("distill_jsd"). teacher_topk = k > 0: a sparse teacher, its top-k
    ids (topk_ids_dtype) and log-probs passed as teacher_topk_ids= / teacher_topk_logprobs=
    [rows, k] instead of teacher_logits (ids < 0: padding).

    Tensor parallelism: with vocab_global and ranks set, the plan is the shard [vocab_start,
    vocab_start + vocab) of the vocabulary; run it with stats(), an all-gather of the blocks, and
    finish(), or with nccl() on an NCCL communicator. A plan of two exchanges (dense distill_jsd:
    exchanges == 2) runs middle() on the gathered blocks, a second all-gather of its blocks, and
    finish(..., gathered_middle=). check=False skips the checks that synchronise with the GPU
    (labels in range, gathered headers)."""

    def __init__(self, vocab: int, dtype, *, terms=("ce",), device: str = "cpu", labels_dtype="int64",
                 ce_weight=1.0, z_weight=1.0, entropy_weight=1.0, distill_weight=1.0,
                 grpo_weight=1.0, kl_ref_beta=1.0, label_smoothing=0.0, logit_scale=0.0,
                 softcap=0.0, teacher_temperature=0.0, student_temperature=0.0, eps_low=0.0,
                 eps_high=0.0, ignore_index: Optional[int] = None, grad: Optional[str] = "write",
                 grad_dtype=None, check: bool = True, vocab_start: int = 0,
                 vocab_global: int = 0, ranks: int = 0, dual_clip=0.0, cispo_weight=1.0,
                 cispo_eps_high=0.0, kl_estimator="k3", ratio_level="token", rollout_correction=None,
                 rollout_level="token", rollout_cap=0.0, rollout_floor=0.0, cu_seqlens_dtype=None,
                 jsd_beta=0.0, teacher_topk: int = 0, topk_ids_dtype="int64",
                 _linear: Optional[dict] = None):
        bits = terms if isinstance(terms, int) else sum(TERMS[t] for t in terms)
        d = _Desc(ctypes.sizeof(_Desc), BACKEND_CUDA if device == "cuda" else BACKEND_CPU, vocab,
                  DTYPE_NONE if dtype is None else dtype_code(dtype),
                  DTYPE_NONE if labels_dtype is None else dtype_code(labels_dtype),
                  bits, 0 if check else UNCHECKED, ce_weight, z_weight,
                  entropy_weight, distill_weight, grpo_weight, kl_ref_beta, label_smoothing,
                  logit_scale, softcap, teacher_temperature, student_temperature, eps_low, eps_high)
        if ignore_index is not None:
            d.use_ignore_index, d.ignore_index = 1, ignore_index
        d.grad_mode = GRAD_MODES[grad]
        d.grad_dtype = DTYPE_NONE if grad_dtype is None else dtype_code(grad_dtype)
        d.vocab_start, d.vocab_global, d.ranks = vocab_start, vocab_global, ranks
        d.dual_clip, d.cispo_weight, d.cispo_eps_high = dual_clip, cispo_weight, cispo_eps_high
        d.kl_estimator = kl_estimator_code(kl_estimator)
        d.ratio_level = code_of(LEVELS, "ratio_level", ratio_level)
        d.rollout_correction = code_of(ROLLOUT_CORRECTIONS, "rollout_correction", rollout_correction)
        d.rollout_level = code_of(LEVELS, "rollout_level", rollout_level)
        d.rollout_cap, d.rollout_floor = rollout_cap, rollout_floor
        if cu_seqlens_dtype is None and (d.ratio_level or d.rollout_level):
            cu_seqlens_dtype = "int32"
        d.cu_seqlens_dtype = DTYPE_NONE if cu_seqlens_dtype is None else dtype_code(cu_seqlens_dtype)
        d.jsd_beta, d.teacher_topk = jsd_beta, teacher_topk
        d.teacher_topk_ids_dtype = dtype_code(topk_ids_dtype) if teacher_topk else DTYPE_NONE
        for k, v in (_linear or {}).items():
            setattr(d, k, v)
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
        """The workspace size a call on `rows` rows runs fastest with."""
        return self.workspace_sizes(rows)[1]

    def workspace_sizes(self, rows: int) -> tuple:
        """(min_bytes, fast_bytes) of the workspace for `rows` rows (hl_loss_plan_get_workspace_sizes)."""
        lo, hi = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _check(_ws_sizes(self._handle, rows, ctypes.byref(lo), ctypes.byref(hi)))
        return lo.value, hi.value

    def __call__(self, logits, labels=None, *, weights=None, teacher_logits=None, advantages=None,
                 old_logprobs=None, ref_logprobs=None, rollout_logprobs=None, cu_seqlens=None,
                 divisor: float = 0.0, grad_scale: float = 0.0, grad=None, token_outputs: bool = False,
                 in_place: bool = False, scalars=None, tokens=None, teacher_topk_ids=None,
                 teacher_topk_logprobs=None) -> LossOutput:
        """Runs the plan. grad: an existing gradient (written, or accumulated into with
        grad='accumulate'); in_place writes the gradient over the logits. scalars / tokens
        (4 arrays: loss, logp, entropy, lse): optional preallocated fp32 outputs."""
        inputs = dict(weights=weights, teacher_logits=teacher_logits, advantages=advantages,
                      old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                      rollout_logprobs=rollout_logprobs, cu_seqlens=cu_seqlens,
                      teacher_topk_ids=teacher_topk_ids, teacher_topk_logprobs=teacher_topk_logprobs)
        a, lv, out = self._args(logits, labels, inputs, divisor, grad_scale, grad, token_outputs,
                                in_place, scalars, tokens)
        ws, wp, nbytes = self._workspace(lv, a.rows)
        _check(_execute(self._handle, ctypes.byref(a), wp, nbytes, lv.stream))
        return out

    def workspace(self, like, rows: int, nbytes: Optional[int] = None):
        """A workspace array for `rows` rows on `like`'s device (fast_bytes unless nbytes), to pass
        as workspace= (the fused linear form's statistics and finish steps share one)."""
        nbytes = self.workspace_bytes(rows) if nbytes is None else nbytes
        return empty(view(like, "like"), ((nbytes + 15) // 16 * 4,), DTYPE_F32) if nbytes else None

    def _topk_dtypes(self) -> dict:
        """The dtypes a sparse teacher's arrays must have."""
        return {"teacher_topk_ids": self.desc.teacher_topk_ids_dtype or DTYPE_I64,
                "teacher_topk_logprobs": DTYPE_F32}

    def _check_topk(self, views: dict, rows: int) -> None:
        """ValueError for a sparse teacher's array that is not [rows, teacher_topk] (the library
        reads k entries a row through a bare pointer)."""
        k = self.desc.teacher_topk
        for name in ("teacher_topk_ids", "teacher_topk_logprobs"):
            if views.get(name) is not None:
                r, c, _ = views[name].rows_view(name)
                if (r, c) != (rows, k):
                    raise ValueError(f"{name} is [{r}, {c}]; the plan takes [rows = {rows}, teacher_topk = {k}]")

    def _workspace(self, lv, rows, ws=None):
        """(array, pointer, bytes) of the given or a fresh workspace (None, None, 0 if none)."""
        if ws is None:
            nbytes = self.workspace_bytes(rows)
            if not nbytes:
                return None, None, 0
            ws = empty(lv, ((nbytes + 15) // 16 * 4,), DTYPE_F32)
        wv = view(ws, "workspace")
        return ws, wv.ptr, int(np.prod(wv.shape)) * _ITEMSIZE[wv.dtype]

    @property
    def exchanges(self) -> int:
        """All-gathers the split takes: 1, or 2 with a middle step (dense distill_jsd)."""
        n = ctypes.c_int(0)
        _check(_exchanges(self._handle, ctypes.byref(n)))
        return n.value

    def middle_bytes(self, rows: int) -> int:
        """Bytes of one rank's middle block for `rows` rows (a plan of two exchanges)."""
        n = ctypes.c_size_t(0)
        _check(_middle_size(self._handle, rows, ctypes.byref(n)))
        return n.value

    def stats_bytes(self, rows: int) -> int:
        """Bytes of one rank's block of statistics for `rows` rows."""
        n = ctypes.c_size_t(0)
        _check(_stats_size(self._handle, rows, ctypes.byref(n)))
        return n.value

    def stats(self, logits, labels=None, *, teacher_logits=None, teacher_topk_ids=None,
              teacher_topk_logprobs=None):
        """Step 1 of the sharded loss: this rank's block of per-row statistics, an int64 array on
        the logits' device, to all-gather across the ranks (torch.distributed.all_gather_into_tensor,
        cupy / NCCL, ...)."""
        inputs = dict(teacher_logits=teacher_logits, teacher_topk_ids=teacher_topk_ids,
                      teacher_topk_logprobs=teacher_topk_logprobs)
        a, lv, _ = self._args(logits, labels, inputs, 0.0, 0.0, None, False, False, None, None,
                              outputs=False)
        return self._stats_call(a, lv, None)

    def _stats_call(self, a, lv, workspace):
        block = empty(lv, (self.stats_bytes(a.rows) // 8,), DTYPE_I64)
        ws, wp, nbytes = (None, None, 0) if workspace is None else self._workspace(lv, a.rows, workspace)
        _check(_stats(self._handle, ctypes.byref(a), view(block, "stats").ptr, self.stats_bytes(a.rows),
                      wp, nbytes, lv.stream))
        return block

    def middle(self, gathered, logits, labels=None, *, teacher_logits=None):
        """Step 2a of a plan of two exchanges: from the gathered blocks, this rank's middle block
        (an int64 array on the logits' device) to all-gather like the first."""
        a, lv, _ = self._args(logits, labels, dict(teacher_logits=teacher_logits), 0.0, 0.0, None, False,
                              False, None, None, outputs=False)
        return self._middle_call(a, lv, gathered, None)

    def _middle_call(self, a, lv, gathered, workspace):
        mbytes = self.middle_bytes(a.rows)
        block = empty(lv, (mbytes // 8,), DTYPE_I64)
        gv, gbytes = _blocks(gathered, "gathered")
        ws, wp, nbytes = self._workspace(lv, a.rows, workspace)
        _check(_middle(self._handle, ctypes.byref(a), gv.ptr, gbytes, view(block, "middle").ptr, mbytes,
                       wp, nbytes, lv.stream))
        return block

    def finish(self, gathered, logits, labels=None, *, gathered_middle=None, **kwargs) -> LossOutput:
        """Step 3: merges the gathered blocks (every rank's stats(), concatenated; with two
        exchanges also gathered_middle, every rank's middle()) and returns the scalars and
        per-token outputs (identical on every rank) and this shard's gradient. Keyword arguments
        as for calling the plan."""
        a, lv, out = self._call_args(logits, labels, kwargs)
        self._finish_call(a, lv, gathered, gathered_middle, None)
        return out

    def _finish_call(self, a, lv, gathered, gathered_middle, workspace):
        gv, gbytes = _blocks(gathered, "gathered")
        ws, wp, nbytes = self._workspace(lv, a.rows, workspace)
        if gathered_middle is None:
            _check(_finish(self._handle, ctypes.byref(a), gv.ptr, gbytes, wp, nbytes, lv.stream))
        else:
            mv, mbytes = _blocks(gathered_middle, "gathered_middle")
            _check(_finish_with_middle(self._handle, ctypes.byref(a), gv.ptr, gbytes, mv.ptr, mbytes, wp,
                                       nbytes, lv.stream))

    def nccl(self, comm, logits, labels=None, **kwargs) -> LossOutput:
        """The three steps on an NCCL communicator of `ranks` ranks (an ncclComm_t as an int, e.g.
        cupy.cuda.nccl.NcclCommunicator.ptr), on the logits' current stream. Every rank calls it."""
        a, lv, out = self._call_args(logits, labels, kwargs)
        ws, wp, nbytes = self._workspace(lv, a.rows)
        _check(_nccl(self._handle, ctypes.byref(a), int(comm), wp, nbytes, lv.stream))
        return out

    def _call_args(self, logits, labels, kwargs):
        kwargs = dict(kwargs)  # the caller's keeps its arrays alive through the call (bare pointers)
        inputs = {k: kwargs.pop(k, None) for k in INPUTS}
        rest = (kwargs.pop("divisor", 0.0), kwargs.pop("grad_scale", 0.0), kwargs.pop("grad", None),
                kwargs.pop("token_outputs", False), kwargs.pop("in_place", False),
                kwargs.pop("scalars", None), kwargs.pop("tokens", None))
        if kwargs:
            raise TypeError(f"unexpected arguments: {sorted(kwargs)}")
        return self._args(logits, labels, inputs, *rest)

    def _args(self, logits, labels, inputs, divisor, grad_scale, grad, token_outputs, in_place, scalars,
              tokens, outputs=True):
        """The hl_loss_args_t of one call (inputs: the INPUTS given, by name), its logits' view and
        the LossOutput it fills (outputs allocated here unless passed; none for the statistics step)."""
        lv = view(logits, "logits")
        rows, cols, ls = lv.rows_view("logits")
        if cols != self.vocab:
            raise ValueError(f"logits have {cols} columns; the plan's vocab is {self.vocab}")
        opt = {k: (None if x is None else view(x, k)) for k, x in dict(inputs, labels=labels).items()}
        same_place([lv] + [v for v in opt.values()], "loss plan")
        d = self.desc
        _check_arrays(dict(opt, logits=lv).items(), {"logits": d.logits_dtype, "teacher_logits": d.logits_dtype,
                                              "labels": d.labels_dtype, "cu_seqlens": d.cu_seqlens_dtype,
                                              **self._topk_dtypes()})
        self._check_topk(opt, rows)
        a = _Args(ctypes.sizeof(_Args), rows, lv.ptr, ls)
        _set_inputs(a, opt, d)
        _set_strides(a, opt, (("teacher_logits", "teacher_stride"),) + _TOPK_STRIDES)
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
            _check_arrays([("grad", gv)], {"grad": d.grad_dtype or d.logits_dtype})
            a.grad, a.grad_stride = gv.ptr, gv.rows_view("grad")[2]
        toks = _scalar_outputs(a, lv, lv.shape[:-1], token_outputs, scalars, tokens)
        return a, lv, LossOutput(toks[0], grad if self.grad_mode else None, *toks[1:])


class LinearLossOutput(NamedTuple):
    scalars: Any                      # fp32 [len(SCALARS)] array on the inputs' device
    grad_hidden: Optional[Any]        # [rows, hidden], with grad_hidden
    grad_weight: Optional[Any]        # [vocab, hidden], with grad_weight
    token_loss: Optional[Any] = None
    token_logp: Optional[Any] = None
    token_entropy: Optional[Any] = None
    token_lse: Optional[Any] = None

    as_dict = LossOutput.as_dict


class LinearLossPlan(LossPlan):
    """The fused linear form of the plan (headloss.h, "The fused linear form"): hidden states
    [rows, hidden] and the head's weight [vocab, hidden] (nn.Linear.weight; a shard's rows under
    tensor parallelism) instead of logits, which exist only a chunk of rows at a time in the
    workspace. Every term, metric and option of LossPlan applies to the logits hidden @ weight.T.

    dtype: the dtype of hidden and weight (and of the logits between the products on CUDA).
    grad_hidden / grad_weight: "write", "accumulate" or None; grad_*_dtype: None (the weight's) or
    "float32". teacher_hidden > 0: distillation from a teacher given as its own hidden states and
    weight (teacher_hidden= / teacher_weight= at call time) instead of teacher_logits."""

    def __init__(self, vocab: int, hidden: int, dtype, *, grad_hidden: Optional[str] = "write",
                 grad_weight: Optional[str] = "write", grad_hidden_dtype=None, grad_weight_dtype=None,
                 teacher_hidden: int = 0, **options):
        for k in ("grad", "grad_dtype"):
            if k in options:
                raise TypeError(f"{k} is the logits form's; use grad_hidden / grad_weight")
        code = lambda dt: DTYPE_NONE if dt is None else dtype_code(dt)  # noqa: E731
        linear = dict(hidden=hidden, weight_dtype=dtype_code(dtype), teacher_hidden=teacher_hidden,
                      grad_hidden_mode=GRAD_MODES[grad_hidden], grad_hidden_dtype=code(grad_hidden_dtype),
                      grad_weight_mode=GRAD_MODES[grad_weight], grad_weight_dtype=code(grad_weight_dtype))
        super().__init__(vocab, None, grad=None, _linear=linear, **options)
        self.hidden = hidden

    def __call__(self, hidden, weight, labels=None, *, grad_hidden=None, grad_weight=None,
                 workspace=None, **kwargs) -> LinearLossOutput:
        """Runs the plan. grad_hidden / grad_weight: existing arrays to write (or accumulate into);
        allocated here otherwise. workspace: an array of at least workspace_sizes(rows)[0] bytes
        (default: a fresh one of fast_bytes). Other keywords as LossPlan.__call__, plus
        teacher_hidden / teacher_weight."""
        a, lv, out = self._linear_args(hidden, weight, labels, kwargs, grad_hidden, grad_weight)
        ws, wp, nbytes = self._workspace(lv, a.rows, workspace)
        _check(_execute(self._handle, ctypes.byref(a), wp, nbytes, lv.stream))
        return out

    def stats(self, hidden, weight, labels=None, *, teacher_hidden=None, teacher_weight=None,
              teacher_logits=None, teacher_topk_ids=None, teacher_topk_logprobs=None, workspace=None):
        """Step 1 of the sharded loss (see LossPlan.stats). Pass the same workspace to finish()
        (and middle()): when it holds every row's logits (fast_bytes of a sharded plan) they
        reuse them."""
        kw = dict(teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_logits=teacher_logits,
                  teacher_topk_ids=teacher_topk_ids, teacher_topk_logprobs=teacher_topk_logprobs)
        a, lv, _ = self._linear_args(hidden, weight, labels, kw, None, None, outputs=False)
        if workspace is None and lv.backend == BACKEND_CUDA:
            workspace = self.workspace(hidden, a.rows, self.workspace_sizes(a.rows)[0])
        return self._stats_call(a, lv, workspace)

    def middle(self, gathered, hidden, weight, labels=None, *, teacher_hidden=None, teacher_weight=None,
               teacher_logits=None, workspace=None):
        """Step 2a of a plan of two exchanges (see LossPlan.middle); pass stats()' workspace."""
        kw = dict(teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_logits=teacher_logits)
        a, lv, _ = self._linear_args(hidden, weight, labels, kw, None, None, outputs=False)
        return self._middle_call(a, lv, gathered, workspace)

    def finish(self, gathered, hidden, weight, labels=None, *, grad_hidden=None, grad_weight=None,
               workspace=None, gathered_middle=None, **kwargs) -> LinearLossOutput:
        """Step 3: as LossPlan.finish; grad_hidden is this rank's part (sum it over the ranks)."""
        a, lv, out = self._linear_args(hidden, weight, labels, kwargs, grad_hidden, grad_weight)
        self._finish_call(a, lv, gathered, gathered_middle, workspace)
        return out

    def nccl(self, comm, hidden, weight, labels=None, *, grad_hidden=None, grad_weight=None,
             workspace=None, **kwargs) -> LinearLossOutput:
        """The three steps and the all-reduce of grad_hidden on an NCCL communicator."""
        a, lv, out = self._linear_args(hidden, weight, labels, kwargs, grad_hidden, grad_weight)
        ws, wp, nbytes = self._workspace(lv, a.rows, workspace)
        _check(_nccl(self._handle, ctypes.byref(a), int(comm), wp, nbytes, lv.stream))
        return out

    def _linear_args(self, hidden, weight, labels, kwargs, grad_hidden, grad_weight, outputs=True):
        kwargs = dict(kwargs)
        th, tw = kwargs.pop("teacher_hidden", None), kwargs.pop("teacher_weight", None)
        opt = {k: kwargs.pop(k, None) for k in INPUTS}
        divisor, grad_scale = kwargs.pop("divisor", 0.0), kwargs.pop("grad_scale", 0.0)
        token_outputs, scalars, tokens = (kwargs.pop("token_outputs", False), kwargs.pop("scalars", None),
                                          kwargs.pop("tokens", None))
        if kwargs:
            raise TypeError(f"unexpected arguments: {sorted(kwargs)}")
        hv, wv = view(hidden, "hidden"), view(weight, "weight")
        rows, cols, hs = hv.rows_view("hidden")
        vocab, wcols, ws = wv.rows_view("weight")
        if cols != self.hidden or wcols != self.hidden:
            raise ValueError(f"hidden has {cols} and weight {wcols} columns; the plan's hidden is {self.hidden}")
        if vocab != self.vocab:
            raise ValueError(f"weight has {vocab} rows; the plan's vocab is {self.vocab}")
        opt.update(labels=labels, teacher_hidden=th, teacher_weight=tw)
        views = {k: (None if x is None else view(x, k)) for k, x in opt.items()}
        same_place([hv, wv] + list(views.values()), "loss plan")
        d = self.desc
        wd = d.weight_dtype
        _check_arrays(dict(views, hidden=hv, weight=wv).items(),
                       dict(hidden=wd, weight=wd, teacher_hidden=wd, teacher_weight=wd, teacher_logits=wd,
                            labels=d.labels_dtype, cu_seqlens=d.cu_seqlens_dtype, **self._topk_dtypes()))
        self._check_topk(views, rows)
        a = _Args(ctypes.sizeof(_Args), rows)
        a.hidden, a.hidden_stride, a.weight, a.weight_stride = hv.ptr, hs, wv.ptr, ws
        _set_inputs(a, views, d)
        _set_strides(a, views, (("teacher_logits", "teacher_stride"), ("teacher_hidden", "teacher_hidden_stride"),
                                ("teacher_weight", "teacher_weight_stride")) + _TOPK_STRIDES)
        a.divisor, a.grad_scale = divisor, grad_scale
        if not outputs:
            return a, hv, None
        grads = []
        for mode, dt, given, shape, ptr, stride in (
                (d.grad_hidden_mode, d.grad_hidden_dtype, grad_hidden, (rows, cols), "grad_hidden", "grad_hidden_stride"),
                (d.grad_weight_mode, d.grad_weight_dtype, grad_weight, (vocab, cols), "grad_weight", "grad_weight_stride")):
            g = None
            if mode:
                g = given if given is not None else empty(hv, shape, dt or wd)
                gv = view(g, ptr)
                _check_arrays([(ptr, gv)], {ptr: dt or wd})
                setattr(a, ptr, gv.ptr)
                setattr(a, stride, gv.rows_view(ptr)[2])
            grads.append(g)
        toks = _scalar_outputs(a, hv, (rows,), token_outputs, scalars, tokens)
        return a, hv, LinearLossOutput(toks[0], *grads, *toks[1:])


def _blocks(x, name):
    """The view and bytes of a contiguous buffer of gathered blocks."""
    v = view(x, name)
    if v.strides != tuple(int(np.prod(v.shape[i + 1:])) for i in range(len(v.shape))):
        raise ValueError(f"{name} must be contiguous")
    return v, int(np.prod(v.shape)) * _ITEMSIZE.get(v.dtype, 0)


_TOPK_STRIDES = (("teacher_topk_ids", "teacher_topk_ids_stride"),
                 ("teacher_topk_logprobs", "teacher_topk_logprobs_stride"))


def _set_strides(a, views, fields) -> None:
    """a's row strides of the 2-D inputs passed: (name, stride field) pairs."""
    for k, field in fields:
        if views.get(k) is not None:
            setattr(a, field, views[k].rows_view(k)[2])


def _scalar_outputs(a, like, token_shape, token_outputs, scalars, tokens) -> list:
    """[scalars, 4 per-token outputs or None]: the given fp32 arrays, else new ones, set in a."""
    if scalars is None:
        scalars = empty(like, (len(SCALARS),), DTYPE_F32)
    sv = view(scalars, "scalars")
    toks = list(tokens) if tokens is not None else [None] * 4
    if token_outputs and tokens is None:
        toks = [empty(like, token_shape, DTYPE_F32) for _ in range(4)]
    tv = [None if t is None else view(t, "token") for t in toks]
    _check_arrays([("scalars", sv)] + [("token", t) for t in tv])
    a.scalars = sv.ptr
    if tv[0] is not None:
        a.token_loss, a.token_logp, a.token_entropy, a.token_lse = (t.ptr for t in tv)
    return [scalars] + toks


@lru_cache(maxsize=64)
def _cached_plan(vocab, dtype, device, key):
    return LossPlan(vocab, dtype, device=device, **dict(key))


def fused_loss(logits, labels=None, *, terms=("ce",), weights=None, teacher_logits=None,
               advantages=None, old_logprobs=None, ref_logprobs=None, rollout_logprobs=None,
               cu_seqlens=None, divisor: float = 0.0, grad_scale: float = 0.0,
               token_outputs: bool = False, grad: Optional[str] = "write", teacher_topk_ids=None,
               teacher_topk_logprobs=None, **options) -> LossOutput:
    """One call: builds (and caches) the plan for these options and runs it. Returns the scalars
    (see SCALARS and LossOutput.as_dict), the gradient and, on request, per-token outputs."""
    lv = view(logits, "logits")
    device = "cuda" if lv.backend == BACKEND_CUDA else "cpu"
    ldt = None if labels is None else view(labels, "labels").dtype
    if cu_seqlens is not None:
        options.setdefault("cu_seqlens_dtype", DTYPE_NAMES[view(cu_seqlens, "cu_seqlens").dtype])
    key = dict(options, terms=tuple(terms) if not isinstance(terms, int) else terms, grad=grad,
               labels_dtype={None: None, DTYPE_I32: "int32", DTYPE_I64: "int64"}[ldt])
    plan = _cached_plan(lv.shape[-1], DTYPE_NAMES[lv.dtype], device, tuple(sorted(key.items())))
    return plan(logits, labels, weights=weights, teacher_logits=teacher_logits,
                advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                rollout_logprobs=rollout_logprobs, cu_seqlens=cu_seqlens, divisor=divisor,
                grad_scale=grad_scale, token_outputs=token_outputs, teacher_topk_ids=teacher_topk_ids,
                teacher_topk_logprobs=teacher_topk_logprobs)


AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")


def aggregation(labels, cu_seqlens, mode: str = "token_mean", *, constant: Optional[float] = None,
                ignore_index: Optional[int] = None, check: bool = True):
    """The plan's `weights` and `divisor` for an RL loss aggregation over sequences: returns
    (weights or None, divisor), to pass to a plan call (either input form, sharded or not: every
    rank passes the same). Each term is sum_t w_t l_t / D, and each metric the w-weighted mean,
    so the metrics' denominators follow the mode:

    - "token_mean": every valid token alike over the batch (DAPO; the plan's default): (None, 0).
    - "seq_mean_token_mean": each sequence's token mean, averaged over the sequences (the original
      GRPO): w_t = 1 / (valid tokens of t's sequence), D = the number of sequences (one with no
      valid token counts as a zero, where verl's mean would be NaN).
    - "seq_mean_token_sum": each sequence's token sum, averaged over the sequences: w = 1, D = the
      number of sequences.
    - "token_sum_norm": the token sum over a constant (Dr. GRPO; e.g. sequences x the generation
      budget): w = 1, D = constant.

    labels [rows] (negative, or ignore_index: not valid, as the plan), cu_seqlens [sequences + 1]
    (0, the running ends, rows), both NumPy, CuPy or PyTorch arrays; weights come back as fp32 on
    labels' device, without a host synchronisation (check=False skips the one the cu_seqlens check
    costs on a device)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation mode {mode!r}; expected one of {AGGREGATIONS}")
    if mode == "token_sum_norm" and not (constant is not None and constant > 0 and np.isfinite(constant)):
        raise ValueError(f"token_sum_norm needs a positive constant, got {constant!r}")
    if labels.ndim != 1 or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"labels must be [rows] and cu_seqlens [sequences + 1]; got shapes "
                         f"{tuple(labels.shape)} and {tuple(cu_seqlens.shape)}")
    rows, sequences = int(labels.shape[0]), int(cu_seqlens.shape[0]) - 1
    module = type(labels).__module__.split(".")[0]  # numpy, cupy or torch
    if check:
        cu = (cu_seqlens.cpu().numpy() if module == "torch" else
              cu_seqlens.get() if module == "cupy" else np.asarray(cu_seqlens))
        if cu[0] != 0 or cu[-1] != rows or np.any(np.diff(cu) < 0):
            raise ValueError(f"cu_seqlens must rise from 0 to rows ({rows}); got {cu.tolist()}")
    if mode == "token_mean":
        return None, 0.0
    if mode == "token_sum_norm":
        return None, float(constant)
    if mode == "seq_mean_token_sum":
        return None, float(sequences)
    valid = labels >= 0
    if ignore_index is not None:
        valid = valid & (labels != ignore_index)
    if module == "torch":
        import torch as t
        cu = cu_seqlens.to(labels.device, t.int64)
        counts = t.cat([t.zeros(1, dtype=t.float64, device=labels.device), t.cumsum(valid.double(), 0)])
        n = counts[cu[1:]] - counts[cu[:-1]]
        seq = t.searchsorted(cu[1:], t.arange(rows, device=labels.device), right=True)
        inv = t.where(n > 0, 1.0 / t.clamp(n, min=1.0), t.zeros_like(n))
        return inv[seq].float(), float(sequences)
    xp = np if module == "numpy" else __import__(module)
    cu = xp.asarray(cu_seqlens).astype(np.int64)
    counts = xp.concatenate([xp.zeros(1), xp.cumsum(valid.astype(np.float64))])
    n = counts[cu[1:]] - counts[cu[:-1]]
    seq = xp.searchsorted(cu[1:], xp.arange(rows), side="right")
    inv = xp.where(n > 0, 1.0 / xp.maximum(n, 1.0), 0.0)
    return inv[seq].astype(np.float32), float(sequences)
