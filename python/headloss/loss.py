"""The fused LM-head loss plan: CE, z-loss, entropy, distillation and GRPO terms, their metrics and
one combined gradient from one pass over the logits (see headloss.h, "Fused LM-head loss plan").

`LossPlan(vocab, dtype, ...)` validates the options once; `plan(logits, labels, ...)` runs it on
NumPy arrays (CPU backend) or PyTorch / CuPy device arrays (CUDA backend, current stream).
`fused_loss(...)` does both with a cached plan. `LinearLossPlan(vocab, hidden, dtype, ...)` is the
fused linear form: `plan(hidden, weight, labels, ...)`, the logits never whole in memory.
Every array is checked against the rows, vocabulary and dtypes the call passes to the library
before the call (HeadlossError naming it); see headloss._loss_options for the options' defaults.
"""
from __future__ import annotations

import ctypes
import math
from functools import lru_cache

import numpy as np
from typing import Any, NamedTuple, Optional

from . import _abi
from ._arrays import DTYPE_NAMES, FLOATS, INTS, ITEMSIZE, ArrayView, dtype_code, empty, expect, view
from ._loss_options import (GRAD_MODES, KL_ESTIMATORS, LEVELS, PLAN_OPTIONS, ROLLOUT_CORRECTIONS,  # noqa: F401
                            SCALARS, TERMS, call_value, describe_options, plan_fields, terms_bits)
from ._lib import (BACKEND_CPU, BACKEND_CUDA, DTYPE_F32, DTYPE_I32, DTYPE_I64, DTYPE_NONE, HeadlossTypeError,
                   HeadlossValueError, code_of, declare, descriptor)
from ._lib import check as _check

c_i64, c_ptr, c_size = ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t
_Desc, _Args = _abi.hl_loss_plan_desc_t, _abi.hl_loss_args_t
# The optional per-row inputs of a call, by keyword (cu_seqlens: [sequences + 1]; a sparse
# teacher's ids and log-probs: [rows, teacher_topk]).
INPUTS = ("weights", "teacher_logits", "advantages", "old_logprobs", "ref_logprobs",
          "rollout_logprobs", "cu_seqlens", "teacher_topk_ids", "teacher_topk_logprobs",
          "grad_token_logp", "grad_token_entropy", "grad_token_lse", "ref_seq_logprobs", "kto_labels")
# Per-sequence inputs of a preference term ([sequences], with cu_seqlens), and their dtypes.
_PER_SEQ = {"ref_seq_logprobs": DTYPE_F32, "kto_labels": DTYPE_I32}
_PER_ROW_F32 = ("weights", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs",
                "grad_token_logp", "grad_token_entropy", "grad_token_lse")
# token_grads= names: the per-token outputs whose upstream gradients calls pass (grad_token_<name>).
TOKEN_GRADS = {"logp": _abi.HL_LOSS_GRAD_TOKEN_LOGP, "entropy": _abi.HL_LOSS_GRAD_TOKEN_ENTROPY,
               "lse": _abi.HL_LOSS_GRAD_TOKEN_LSE}
TOKEN_OUTPUTS = ("token_loss", "token_logp", "token_entropy", "token_lse")
DEVICES = {"cpu": BACKEND_CPU, "cuda": BACKEND_CUDA}


_create = declare("hl_loss_plan_create", ctypes.POINTER(_Desc), ctypes.POINTER(c_ptr))
_ws_sizes = declare("hl_loss_plan_get_workspace_sizes", c_ptr, c_i64, ctypes.POINTER(c_size),
                    ctypes.POINTER(c_size))
_execute = declare("hl_loss_plan_execute", c_ptr, ctypes.POINTER(_Args), c_ptr, c_size, c_ptr)
_destroy = declare("hl_loss_plan_destroy", c_ptr)
_stats_size = declare("hl_loss_plan_get_stats_size", c_ptr, c_i64, ctypes.POINTER(c_size))
_stats = declare("hl_loss_plan_execute_stats_ws", c_ptr, ctypes.POINTER(_Args), c_ptr, c_size,
                 c_ptr, c_size, c_ptr)
_finish = declare("hl_loss_plan_execute_finish", c_ptr, ctypes.POINTER(_Args), c_ptr, c_size,
                  c_ptr, c_size, c_ptr)
_exchanges = declare("hl_loss_plan_get_exchanges", c_ptr, ctypes.POINTER(ctypes.c_int))
_middle_size = declare("hl_loss_plan_get_middle_size", c_ptr, c_i64, ctypes.POINTER(c_size))
_middle = declare("hl_loss_plan_execute_middle", c_ptr, ctypes.POINTER(_Args), c_ptr, c_size,
                  c_ptr, c_size, c_ptr, c_size, c_ptr)
_finish_with_middle = declare("hl_loss_plan_execute_finish_with_middle", c_ptr, ctypes.POINTER(_Args), c_ptr,
                              c_size, c_ptr, c_size, c_ptr, c_size, c_ptr)
_nccl = declare("hl_loss_plan_execute_nccl", c_ptr, ctypes.POINTER(_Args), c_ptr, c_ptr, c_size, c_ptr)


def _optional_dtype(dt, name: str) -> int:
    return DTYPE_NONE if dt is None else dtype_code(dt, name)


def _grad_mode(mode, name: str) -> int:
    return GRAD_MODES["none"] if mode is None else code_of(GRAD_MODES, name, mode)


def _given(code: int, name: str, what: str) -> int:
    """The dtype a plan reads `name` as; HeadlossValueError where the plan was made without it."""
    if code == DTYPE_NONE:
        raise HeadlossValueError(f"{name} is given, but the plan was made without {what}")
    return code


def _token_grad_bits(names) -> int:
    names = (names,) if isinstance(names, str) else tuple(names)
    for n in names:
        if n not in TOKEN_GRADS:
            raise HeadlossValueError(f"token_grads: unknown output {n!r}; expected names of {', '.join(TOKEN_GRADS)}")
    return sum({TOKEN_GRADS[n] for n in names})


class LossOutput(NamedTuple):
    scalars: Any                  # fp32 [len(SCALARS)] array on the logits' device
    grad: Optional[Any]           # the gradient, when the plan has one
    token_loss: Optional[Any] = None
    token_logp: Optional[Any] = None
    token_entropy: Optional[Any] = None
    token_lse: Optional[Any] = None
    token_argmax: Optional[Any] = None  # int64 [rows], with argmax=True

    def as_dict(self) -> dict:
        """The scalars as Python floats by name (synchronises with the device)."""
        s = self.scalars
        vals = s.tolist() if hasattr(s, "tolist") else list(s)
        return dict(zip(SCALARS, (float(v) for v in vals)))


class LossPlan:
    """A validated loss description (hl_loss_plan_desc_t).

    vocab: the logits' columns; dtype: the logits' (float32, float16, bfloat16); device: "cpu"
    (NumPy, torch CPU tensors) or "cuda". terms: a name of TERMS, several (default "ce"), or an int
    of HL_LOSS_* bits. labels_dtype: "int64" (default), "int32" or None (no labels).
    grad: "write" (default), "accumulate" or None; grad_dtype: None (the logits') or "float32".
    ignore_index: None (default: only negative labels are ignored) or an id ignored as well.
    check=False skips the checks that synchronise with the GPU (labels in range, gathered headers).

    Every numeric option defaults to None, the library's default, listed below; an explicit 0
    where the library would read 0 as a nonzero default is refused with the reason (z_weight=0:
    leave "z" out of terms). entropy_weight and kl_ref_beta have no default: set them with their
    terms. kl_estimator "k3" / "k1" / "k2"; ratio_level "token" / "seq_mean" (GSPO; calls pass
    cu_seqlens); rollout_correction "tis" / "mis" / "reject" (calls pass rollout_logprobs) at
    rollout_level "token" / "seq_product" / "seq_mean", with rollout_cap / rollout_floor.
    cu_seqlens_dtype: the calls' cu_seqlens dtype (default "int32" where an option is
    sequence-level, as flash-attn's). jsd_beta: "distill_jsd"'s beta. teacher_topk = k > 0: a
    sparse teacher, its top-k ids (topk_ids_dtype, default "int64") and log-probs passed as
    teacher_topk_ids= / teacher_topk_logprobs= [rows, k] instead of teacher_logits (ids < 0:
    padding).
    token_grads: a name or names of "logp", "entropy", "lse" (TOKEN_GRADS): calls pass the upstream
    gradients of those per-token outputs, grad_token_logp= etc. [rows] fp32, and the gradient adds
    their vector-Jacobian product (unweighted: neither weights, divisor nor grad_scale apply; with
    terms=() it is the product alone). Temperature T: logit_scale = 1 / T.
    token_scaling=True (Liger's use_token_scaling; terms "ce" and "z" only): each token's loss and
    gradient times its own p_y = exp(logp), a constant; D, the weights and the metrics unchanged.

    Tensor parallelism: with vocab_global and ranks set, the plan is the shard [vocab_start,
    vocab_start + vocab) of the vocabulary; run it with stats(), an all-gather of the blocks, and
    finish(), or with nccl() on an NCCL communicator. A plan of two exchanges (dense distill_jsd:
    exchanges == 2) runs middle() on the gathered blocks, a second all-gather of its blocks, and
    finish(..., gathered_middle=).

    Options and defaults:
{options}
    """

    def __init__(self, vocab: int, dtype, *, terms=("ce",), device: str = "cpu", labels_dtype="int64",
                 ignore_index: Optional[int] = None, grad: Optional[str] = "write", grad_dtype=None,
                 check: bool = True, ce_weight=None, z_weight=None, entropy_weight=None,
                 distill_weight=None, grpo_weight=None, kl_ref_beta=None, label_smoothing=None,
                 logit_scale=None, softcap=None, teacher_temperature=None, student_temperature=None,
                 eps_low=None, eps_high=None, dual_clip=None, cispo_weight=None, cispo_eps_high=None,
                 kl_estimator=None, ratio_level=None, rollout_correction=None, rollout_level=None,
                 rollout_cap=None, rollout_floor=None, cu_seqlens_dtype=None, jsd_beta=None,
                 teacher_topk=None, topk_ids_dtype="int64", vocab_start=None, vocab_global=None,
                 ranks=None, token_grads=(), token_scaling: bool = False, preference=None,
                 pref_loss_type=None, pref_logp=None, pref_weight=None, pref_beta=None, pref_gamma=None,
                 pref_label_smoothing=None, pref_tau=None, kto_desirable_weight=None,
                 kto_undesirable_weight=None, _linear: Optional[dict] = None, **unknown):
        plan_fields(unknown)  # HeadlossTypeError naming the first unknown option
        local = locals()
        fields = plan_fields({k: local[k] for k in PLAN_OPTIONS})
        if device not in DEVICES:
            raise HeadlossValueError(f"device is {device!r}; expected 'cpu' or 'cuda'")
        sequence_level = fields.get("ratio_level") or fields.get("rollout_level")
        if cu_seqlens_dtype is None and (sequence_level or terms_bits(terms) & _abi.HL_LOSS_PREFERENCE):
            cu_seqlens_dtype = "int32"
        d = descriptor(_Desc, backend=DEVICES[device], vocab=vocab, terms=terms_bits(terms),
                       logits_dtype=_optional_dtype(dtype, "dtype"),
                       labels_dtype=_optional_dtype(labels_dtype, "labels_dtype"),
                       flags=((0 if check else _abi.HL_LOSS_UNCHECKED) | _token_grad_bits(token_grads) |
                              (_abi.HL_LOSS_TOKEN_SCALING if token_scaling else 0)),
                       grad_mode=_grad_mode(grad, "grad"),
                       grad_dtype=_optional_dtype(grad_dtype, "grad_dtype"),
                       cu_seqlens_dtype=_optional_dtype(cu_seqlens_dtype, "cu_seqlens_dtype"), **fields)
        if ignore_index is not None:
            d.use_ignore_index, d.ignore_index = 1, ignore_index
        if d.teacher_topk:
            d.teacher_topk_ids_dtype = dtype_code(topk_ids_dtype, "topk_ids_dtype")
        for k, v in (_linear or {}).items():
            setattr(d, k, v)
        self.vocab, self.terms, self.desc = vocab, d.terms, d
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
        lo, hi = c_size(0), c_size(0)
        _check(_ws_sizes(self._handle, rows, ctypes.byref(lo), ctypes.byref(hi)))
        return lo.value, hi.value

    def __call__(self, logits, labels=None, *, weights=None, teacher_logits=None, advantages=None,
                 old_logprobs=None, ref_logprobs=None, rollout_logprobs=None, cu_seqlens=None,
                 divisor: Optional[float] = None, grad_scale: Optional[float] = None, grad=None,
                 token_outputs: bool = False, in_place: bool = False, scalars=None, tokens=None,
                 teacher_topk_ids=None, teacher_topk_logprobs=None, grad_token_logp=None,
                 grad_token_entropy=None, grad_token_lse=None, ref_seq_logprobs=None,
                 kto_labels=None, argmax=False) -> LossOutput:
        """Runs the plan on logits [..., vocab] (leading dims flattened to rows; rows may have a
        stride, the last dimension contiguous). labels and the per-row fp32 inputs (weights,
        advantages, old / ref / rollout log-probs) have one packed element a row; teacher_logits
        is [rows, vocab] in the logits' dtype; cu_seqlens [sequences + 1]; a sparse teacher's ids
        and log-probs [rows, teacher_topk]. divisor: D (default None: the sum of the valid rows'
        weights); grad_scale: the gradient's factor (default None: 1).
        grad: an existing gradient [rows, vocab] (written, or accumulated into with
        grad='accumulate'); in_place writes the gradient over the logits. scalars ([len(SCALARS)])
        / tokens (4 arrays [rows]: loss, logp, entropy, lse): optional preallocated fp32 outputs.
        grad_token_logp / _entropy / _lse: the upstream gradients the plan's token_grads name.
        ref_seq_logprobs (fp32) / kto_labels (int32) [sequences]: a preference term's per-sequence
        inputs (headloss.h, "Preference losses").
        argmax: True (or an int64 [rows] array) for token_argmax, each row's first maximal column.
        Every array is checked before the call: HeadlossError naming the one at fault."""
        inputs = dict(weights=weights, teacher_logits=teacher_logits, advantages=advantages,
                      old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                      rollout_logprobs=rollout_logprobs, cu_seqlens=cu_seqlens,
                      teacher_topk_ids=teacher_topk_ids, teacher_topk_logprobs=teacher_topk_logprobs,
                      grad_token_logp=grad_token_logp, grad_token_entropy=grad_token_entropy,
                      grad_token_lse=grad_token_lse, ref_seq_logprobs=ref_seq_logprobs,
                      kto_labels=kto_labels)
        a, lv, out = self._args(logits, labels, inputs, divisor, grad_scale, grad, token_outputs,
                                in_place, scalars, tokens, argmax=argmax)
        ws, wp, nbytes = self._workspace(lv, a.rows)
        _check(_execute(self._handle, ctypes.byref(a), wp, nbytes, lv.stream))
        return out

    def workspace(self, like, rows: int, nbytes: Optional[int] = None):
        """A workspace array for `rows` rows on `like`'s device (fast_bytes unless nbytes), to pass
        as workspace= (the fused linear form's statistics and finish steps share one)."""
        nbytes = self.workspace_bytes(rows) if nbytes is None else nbytes
        return empty(view(like, "like"), ((nbytes + 15) // 16 * 4,), DTYPE_F32) if nbytes else None

    def _workspace(self, lv, rows, ws=None):
        """(array, pointer, bytes) of the given or a fresh workspace (None, None, 0 if none)."""
        if ws is None:
            nbytes = self.workspace_bytes(rows)
            if not nbytes:
                return None, None, 0
            ws = empty(lv, ((nbytes + 15) // 16 * 4,), DTYPE_F32)
        wv, nbytes = _buffer(ws, "workspace", lv)
        return ws, wv.ptr, nbytes

    @property
    def exchanges(self) -> int:
        """All-gathers the split takes: 1, or 2 with a middle step (dense distill_jsd)."""
        n = ctypes.c_int(0)
        _check(_exchanges(self._handle, ctypes.byref(n)))
        return n.value

    def middle_bytes(self, rows: int) -> int:
        """Bytes of one rank's middle block for `rows` rows (a plan of two exchanges)."""
        n = c_size(0)
        _check(_middle_size(self._handle, rows, ctypes.byref(n)))
        return n.value

    def stats_bytes(self, rows: int) -> int:
        """Bytes of one rank's block of statistics for `rows` rows."""
        n = c_size(0)
        _check(_stats_size(self._handle, rows, ctypes.byref(n)))
        return n.value

    def stats(self, logits, labels=None, *, teacher_logits=None, teacher_topk_ids=None,
              teacher_topk_logprobs=None):
        """Step 1 of the sharded loss: this rank's block of per-row statistics, an int64 array on
        the logits' device, to all-gather across the ranks (torch.distributed.all_gather_into_tensor,
        cupy / NCCL, ...)."""
        inputs = dict(teacher_logits=teacher_logits, teacher_topk_ids=teacher_topk_ids,
                      teacher_topk_logprobs=teacher_topk_logprobs)
        a, lv, _ = self._args(logits, labels, inputs, None, None, None, False, False, None, None,
                              outputs=False)
        return self._stats_call(a, lv, None)

    def _stats_call(self, a, lv, workspace):
        nbytes = self.stats_bytes(a.rows)
        block = empty(lv, (nbytes // 8,), DTYPE_I64)
        ws, wp, ws_bytes = (None, None, 0) if workspace is None else self._workspace(lv, a.rows, workspace)
        _check(_stats(self._handle, ctypes.byref(a), view(block, "stats").ptr, nbytes, wp, ws_bytes,
                      lv.stream))
        return block

    def middle(self, gathered, logits, labels=None, *, teacher_logits=None):
        """Step 2a of a plan of two exchanges: from the gathered blocks, this rank's middle block
        (an int64 array on the logits' device) to all-gather like the first."""
        a, lv, _ = self._args(logits, labels, dict(teacher_logits=teacher_logits), None, None, None, False,
                              False, None, None, outputs=False)
        return self._middle_call(a, lv, gathered, None)

    def _middle_call(self, a, lv, gathered, workspace):
        mbytes = self.middle_bytes(a.rows)
        block = empty(lv, (mbytes // 8,), DTYPE_I64)
        gv, gbytes = _buffer(gathered, "gathered", lv)
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
        gv, gbytes = _buffer(gathered, "gathered", lv)
        mv, mbytes = (None, 0) if gathered_middle is None else _buffer(gathered_middle, "gathered_middle", lv)
        ws, wp, nbytes = self._workspace(lv, a.rows, workspace)
        if mv is None:
            _check(_finish(self._handle, ctypes.byref(a), gv.ptr, gbytes, wp, nbytes, lv.stream))
        else:
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
        rest = (kwargs.pop("divisor", None), kwargs.pop("grad_scale", None), kwargs.pop("grad", None),
                kwargs.pop("token_outputs", False), kwargs.pop("in_place", False),
                kwargs.pop("scalars", None), kwargs.pop("tokens", None))
        argmax = kwargs.pop("argmax", False)
        _no_more(kwargs)
        return self._args(logits, labels, inputs, *rest, argmax=argmax)

    def _args(self, logits, labels, inputs, divisor, grad_scale, grad, token_outputs, in_place, scalars,
              tokens, outputs=True, argmax=False):
        """The hl_loss_args_t of one call (inputs: the INPUTS given, by name), its logits' view and
        the LossOutput it fills (outputs allocated here unless passed; none for the statistics step)."""
        d = self.desc
        lv = expect(logits, "logits", d.logits_dtype, cols=self.vocab)
        rows = lv.rows
        a = descriptor(_Args, rows=rows, logits=lv.ptr, logits_stride=lv.stride, divisor=call_value("divisor", divisor),
                       grad_scale=call_value("grad_scale", grad_scale))
        self._set_inputs(a, lv, labels, inputs)
        if not outputs:
            return a, lv, None
        if self.grad_mode:
            if in_place:
                grad = logits
            elif grad is None:
                grad = empty(lv, lv.shape, d.grad_dtype or lv.dtype)
            gv = expect(grad, "grad", d.grad_dtype or d.logits_dtype, rows=rows, cols=self.vocab, like=lv)
            a.grad, a.grad_stride = gv.ptr, gv.stride
        elif grad is not None or in_place:
            raise HeadlossValueError("grad is given, but the plan forms no gradient (it was made with grad=None)")
        toks = _scalar_outputs(a, lv, lv.shape[:-1], rows, token_outputs, scalars, tokens, argmax)
        return a, lv, LossOutput(toks[0], grad if self.grad_mode else None, *toks[1:])

    def _set_inputs(self, a, like: ArrayView, labels, inputs: dict) -> None:
        """Checks labels and the optional inputs given against the plan and a.rows, and sets their
        pointers and strides (and num_seqs) in the hl_loss_args_t a."""
        d, rows, k = self.desc, a.rows, self.desc.teacher_topk
        mat = d.weight_dtype or d.logits_dtype  # the teacher's matrices, in the logits' dtype
        for name, x in dict(inputs, labels=labels).items():
            if x is None:
                continue
            if name in _PER_ROW_F32:
                v = expect(x, name, DTYPE_F32, size=rows, like=like)
            elif name == "labels":
                v = expect(x, name, _given(d.labels_dtype, name, "labels (labels_dtype=None)"), size=rows,
                           like=like)
            elif name in _PER_SEQ:
                v = expect(x, name, _PER_SEQ[name], shape=(None,), packed=True, like=like)
            elif name == "cu_seqlens":
                v = expect(x, name, _given(d.cu_seqlens_dtype, name, "cu_seqlens_dtype"), shape=(None,),
                           packed=True, like=like)
                a.num_seqs = max(v.shape[0] - 1, 0)
            elif name == "teacher_logits":
                v = expect(x, name, mat, rows=rows, cols=self.vocab, like=like)
            elif name == "teacher_hidden":
                v = expect(x, name, _given(d.teacher_hidden and mat, name, "teacher_hidden"), rows=rows,
                           cols=d.teacher_hidden, like=like)
            elif name == "teacher_weight":
                v = expect(x, name, _given(d.teacher_hidden and mat, name, "teacher_hidden"), rows=self.vocab,
                           cols=d.teacher_hidden, like=like)
            elif name == "teacher_topk_ids":
                v = expect(x, name, _given(d.teacher_topk_ids_dtype, name, "teacher_topk"), rows=rows, cols=k,
                           like=like)
            else:  # teacher_topk_logprobs
                v = expect(x, name, _given(k and DTYPE_F32, name, "teacher_topk"), rows=rows, cols=k, like=like)
            setattr(a, name, v.ptr)
            if name in _STRIDES:
                setattr(a, _STRIDES[name], v.stride)
        for name in _PER_SEQ:
            x = inputs.get(name)
            if x is not None and view(x, name).shape[0] != a.num_seqs:
                raise HeadlossValueError(f"{name} has {view(x, name).shape[0]} elements; cu_seqlens "
                                         f"has {a.num_seqs} sequences")



# The framework front ends' workspace cap for the fused linear form (PyTorch's and JAX's
# max_workspace_bytes default; None lifts it): 1.0-1.3x the time of the plan's fast size at the
# benchmark shapes; the peak is the gradients + 256 MiB, at or below Liger's fused linear CE where
# grad_hidden >= 256 MiB, up to 240 MiB above it at smaller shapes, where Liger's memory costs
# 1.7-10.5x in time (H200, 2026-11-28, docs/python.md "The workspace cap"). LinearLossPlan itself
# takes the fast size unless told otherwise.
DEFAULT_MAX_WORKSPACE_BYTES = 256 << 20


class LinearLossOutput(NamedTuple):
    scalars: Any                      # fp32 [len(SCALARS)] array on the inputs' device
    grad_hidden: Optional[Any]        # [rows, hidden], with grad_hidden
    grad_weight: Optional[Any]        # [vocab, hidden], with grad_weight
    token_loss: Optional[Any] = None
    token_logp: Optional[Any] = None
    token_entropy: Optional[Any] = None
    token_lse: Optional[Any] = None
    grad_bias: Optional[Any] = None   # [vocab], with grad_bias
    token_argmax: Optional[Any] = None  # int64 [rows], with argmax=True

    as_dict = LossOutput.as_dict


class LinearLossPlan(LossPlan):
    """The fused linear form of the plan (headloss.h, "The fused linear form"): hidden states
    [rows, hidden] and the head's weight [vocab, hidden] (nn.Linear.weight; a shard's rows under
    tensor parallelism) instead of logits, which exist only a chunk of rows at a time in the
    workspace. Every term, metric and option of LossPlan applies to the logits hidden @ weight.T
    (the same defaults).

    dtype: the dtype of hidden and weight (and of the logits between the products on CUDA).
    grad_hidden / grad_weight: "write" (default), "accumulate" or None; grad_*_dtype: None (the
    weight's) or "float32". teacher_hidden > 0: distillation from a teacher given as its own
    hidden states and weight (teacher_hidden= / teacher_weight= at call time) instead of
    teacher_logits. A head bias is a call's bias= [vocab] (the logits hidden @ weight.T + bias);
    grad_bias: "write", "accumulate" or None (default), its gradient (the column sums of the
    logits' gradient; grad_bias_dtype as grad_weight_dtype). On CUDA a call with a bias or
    grad_bias takes the row path (headloss.h)."""

    def __init__(self, vocab: int, hidden: int, dtype, *, grad_hidden: Optional[str] = "write",
                 grad_weight: Optional[str] = "write", grad_hidden_dtype=None, grad_weight_dtype=None,
                 teacher_hidden: int = 0, grad_bias: Optional[str] = None, grad_bias_dtype=None, **options):
        for k in ("grad", "grad_dtype"):
            if k in options:
                raise HeadlossTypeError(f"{k} is the logits form's option; use grad_hidden / grad_weight")
        linear = dict(hidden=hidden, weight_dtype=dtype_code(dtype, "dtype"), teacher_hidden=teacher_hidden,
                      grad_hidden_mode=_grad_mode(grad_hidden, "grad_hidden"),
                      grad_hidden_dtype=_optional_dtype(grad_hidden_dtype, "grad_hidden_dtype"),
                      grad_weight_mode=_grad_mode(grad_weight, "grad_weight"),
                      grad_weight_dtype=_optional_dtype(grad_weight_dtype, "grad_weight_dtype"),
                      grad_bias_mode=_grad_mode(grad_bias, "grad_bias"),
                      grad_bias_dtype=_optional_dtype(grad_bias_dtype, "grad_bias_dtype"))
        super().__init__(vocab, None, grad=None, _linear=linear, **options)
        self.hidden = hidden

    def __call__(self, hidden, weight, labels=None, *, grad_hidden=None, grad_weight=None,
                 workspace=None, **kwargs) -> LinearLossOutput:
        """Runs the plan on hidden [..., hidden] (leading dims flattened to rows) and weight
        [vocab, hidden], both in the plan's dtype. grad_hidden [rows, hidden] / grad_weight
        [vocab, hidden]: existing arrays to write (or accumulate into); allocated here otherwise.
        workspace: an array of at least workspace_sizes(rows)[0] bytes (default: a fresh one of
        fast_bytes). Other keywords as LossPlan.__call__, plus teacher_hidden [rows, Ht] /
        teacher_weight [vocab, Ht]. Every array is checked before the call."""
        a, lv, out = self._linear_args(hidden, weight, labels, kwargs, grad_hidden, grad_weight)
        ws, wp, nbytes = self._workspace(lv, a.rows, workspace)
        _check(_execute(self._handle, ctypes.byref(a), wp, nbytes, lv.stream))
        return out

    def stats(self, hidden, weight, labels=None, *, teacher_hidden=None, teacher_weight=None,
              teacher_logits=None, teacher_topk_ids=None, teacher_topk_logprobs=None, workspace=None, bias=None):
        """Step 1 of the sharded loss (see LossPlan.stats). Pass the same workspace to finish()
        (and middle()): when it holds every row's logits (fast_bytes of a sharded plan) they
        reuse them. bias: this shard's, as for every step."""
        kw = dict(teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_logits=teacher_logits,
                  teacher_topk_ids=teacher_topk_ids, teacher_topk_logprobs=teacher_topk_logprobs, bias=bias)
        a, lv, _ = self._linear_args(hidden, weight, labels, kw, None, None, outputs=False)
        if workspace is None and lv.backend == BACKEND_CUDA:
            workspace = self.workspace(hidden, a.rows, self.workspace_sizes(a.rows)[0])
        return self._stats_call(a, lv, workspace)

    def middle(self, gathered, hidden, weight, labels=None, *, teacher_hidden=None, teacher_weight=None,
               teacher_logits=None, workspace=None, bias=None):
        """Step 2a of a plan of two exchanges (see LossPlan.middle); pass stats()' workspace."""
        kw = dict(teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_logits=teacher_logits,
                  bias=bias)
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
        opt = {k: kwargs.pop(k, None) for k in INPUTS + ("teacher_hidden", "teacher_weight")}
        divisor, grad_scale = kwargs.pop("divisor", None), kwargs.pop("grad_scale", None)
        token_outputs, scalars, tokens = (kwargs.pop("token_outputs", False), kwargs.pop("scalars", None),
                                          kwargs.pop("tokens", None))
        bias, grad_bias, argmax = kwargs.pop("bias", None), kwargs.pop("grad_bias", None), kwargs.pop("argmax", False)
        _no_more(kwargs)
        d, H = self.desc, self.hidden
        hv = expect(hidden, "hidden", d.weight_dtype, cols=H)
        wv = expect(weight, "weight", d.weight_dtype, rows=self.vocab, cols=H, like=hv)
        rows = hv.rows
        a = descriptor(_Args, rows=rows, hidden=hv.ptr, hidden_stride=hv.stride, weight=wv.ptr,
                       weight_stride=wv.stride, divisor=call_value("divisor", divisor), grad_scale=call_value("grad_scale", grad_scale))
        self._set_inputs(a, hv, labels, opt)
        if bias is not None:
            a.bias = expect(bias, "bias", d.weight_dtype, size=self.vocab, like=hv).ptr
        if not outputs:
            return a, hv, None
        grads = []
        for mode, dt, g, n, name in ((d.grad_hidden_mode, d.grad_hidden_dtype, grad_hidden, rows, "grad_hidden"),
                                     (d.grad_weight_mode, d.grad_weight_dtype, grad_weight, self.vocab, "grad_weight")):
            if mode:
                g = empty(hv, (n, H), dt or d.weight_dtype) if g is None else g
                gv = expect(g, name, dt or d.weight_dtype, rows=n, cols=H, like=hv)
                setattr(a, name, gv.ptr)
                setattr(a, name + "_stride", gv.stride)
            elif g is not None:
                raise HeadlossValueError(f"{name} is given, but the plan forms no {name} (it was made with "
                                         f"{name}=None)")
            grads.append(g)
        if d.grad_bias_mode:
            dt = d.grad_bias_dtype or d.weight_dtype
            grad_bias = empty(hv, (self.vocab,), dt) if grad_bias is None else grad_bias
            a.grad_bias = expect(grad_bias, "grad_bias", dt, size=self.vocab, like=hv).ptr
        elif grad_bias is not None:
            raise HeadlossValueError("grad_bias is given, but the plan forms no grad_bias (it was made with "
                                     "grad_bias=None)")
        toks = _scalar_outputs(a, hv, (rows,), rows, token_outputs, scalars, tokens, argmax)
        return a, hv, LinearLossOutput(toks[0], *grads, *toks[1:5], grad_bias, toks[5])


LossPlan.__doc__ = LossPlan.__doc__.format(options=describe_options())
# The row-stride field of each 2-D input.
_STRIDES = {"teacher_logits": "teacher_stride", "teacher_hidden": "teacher_hidden_stride",
            "teacher_weight": "teacher_weight_stride", "teacher_topk_ids": "teacher_topk_ids_stride",
            "teacher_topk_logprobs": "teacher_topk_logprobs_stride"}


def _no_more(kwargs: dict) -> None:
    if kwargs:
        raise HeadlossTypeError(f"unexpected arguments: {', '.join(sorted(kwargs))}")


def _buffer(x, name: str, like: ArrayView):
    """The view and bytes of a contiguous buffer (a workspace, gathered blocks) on like's device."""
    v = expect(x, name, tuple(ITEMSIZE), packed=True, like=like)
    return v, math.prod(v.shape) * ITEMSIZE[v.dtype]


def _scalar_outputs(a, like, token_shape, rows, token_outputs, scalars, tokens, argmax=False) -> list:
    """[scalars, 4 per-token outputs or None, token_argmax or None]: the given arrays (argmax: True
    or an int64 array), else new ones, set in a."""
    if scalars is None:
        scalars = empty(like, (len(SCALARS),), DTYPE_F32)
    sv = expect(scalars, "scalars", DTYPE_F32, size=len(SCALARS), like=like)
    if tokens is None:
        toks = [empty(like, token_shape, DTYPE_F32) if token_outputs else None for _ in TOKEN_OUTPUTS]
    else:
        toks = list(tokens)
        if len(toks) != len(TOKEN_OUTPUTS):
            raise HeadlossValueError(f"tokens has {len(toks)} arrays; expected {len(TOKEN_OUTPUTS)}: "
                                     f"{', '.join(TOKEN_OUTPUTS)}")
    a.scalars = sv.ptr
    for name, t in zip(TOKEN_OUTPUTS, toks):
        if t is not None:
            setattr(a, name, expect(t, name, DTYPE_F32, size=rows, like=like).ptr)
    top = None
    if argmax is not False and argmax is not None:
        top = empty(like, token_shape, DTYPE_I64) if argmax is True else argmax
        a.token_argmax = expect(top, "token_argmax", DTYPE_I64, size=rows, like=like).ptr
    return [scalars] + toks + [top]


@lru_cache(maxsize=64)
def _cached_plan(vocab, dtype, device, key):
    return LossPlan(vocab, dtype, device=device, **dict(key))


def fused_loss(logits, labels=None, *, terms=("ce",), weights=None, teacher_logits=None,
               advantages=None, old_logprobs=None, ref_logprobs=None, rollout_logprobs=None,
               cu_seqlens=None, divisor: Optional[float] = None, grad_scale: Optional[float] = None,
               token_outputs: bool = False, grad: Optional[str] = "write", teacher_topk_ids=None,
               teacher_topk_logprobs=None, **options) -> LossOutput:
    """One call: builds (and caches) the plan for these options and runs it. Returns the scalars
    (see SCALARS and LossOutput.as_dict), the gradient and, on request, per-token outputs.
    Options (terms, the weights, ...) and their defaults as LossPlan's; inputs as its call's."""
    lv = expect(logits, "logits", FLOATS, matrix=True)
    device = "cuda" if lv.backend == BACKEND_CUDA else "cpu"
    labels_dtype = None if labels is None else DTYPE_NAMES[expect(labels, "labels", INTS).dtype]
    if cu_seqlens is not None:
        options.setdefault("cu_seqlens_dtype", DTYPE_NAMES[expect(cu_seqlens, "cu_seqlens", INTS).dtype])
    key = dict(options, terms=terms if isinstance(terms, (str, int)) else tuple(terms), grad=grad,
               labels_dtype=labels_dtype)
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

    - "token_mean": every valid token alike over the batch (DAPO; the plan's default): (None, None).
    - "seq_mean_token_mean": each sequence's token mean, averaged over the sequences (the original
      GRPO): w_t = 1 / (valid tokens of t's sequence), D = the number of sequences (one with no
      valid token counts as a zero, where verl's mean would be NaN).
    - "seq_mean_token_sum": each sequence's token sum, averaged over the sequences: w = 1, D = the
      number of sequences.
    - "token_sum_norm": the token sum over a constant (Dr. GRPO; e.g. sequences x the generation
      budget): w = 1, D = constant.

    labels [rows] (negative, or ignore_index: not valid, as the plan), cu_seqlens [sequences + 1]
    (0, the running ends, rows), both int32 / int64 NumPy, CuPy or PyTorch arrays on one device
    (HeadlossError naming the one at fault otherwise); weights come back as fp32 on
    labels' device, without a host synchronisation (check=False skips the one the cu_seqlens check
    costs on a device)."""
    if mode not in AGGREGATIONS:
        raise HeadlossValueError(f"mode is {mode!r}; expected one of {', '.join(AGGREGATIONS)}")
    if mode == "token_sum_norm" and not (constant is not None and constant > 0 and np.isfinite(constant)):
        raise HeadlossValueError(f"constant is {constant!r}; token_sum_norm needs a positive constant")
    lv = expect(labels, "labels", INTS, shape=(None,))
    cv = expect(cu_seqlens, "cu_seqlens", INTS, shape=(None,), like=lv)
    if cv.shape[0] < 2:
        raise HeadlossValueError(f"cu_seqlens has {cv.shape[0]} entries; expected sequences + 1 >= 2")
    rows, sequences = lv.shape[0], cv.shape[0] - 1
    module = type(labels).__module__.split(".")[0]  # numpy, cupy or torch
    if check:
        cu = (cu_seqlens.cpu().numpy() if module == "torch" else
              cu_seqlens.get() if module == "cupy" else np.asarray(cu_seqlens))
        if cu[0] != 0 or cu[-1] != rows or np.any(np.diff(cu) < 0):
            raise HeadlossValueError(f"cu_seqlens is {cu.tolist()}; it must rise from 0 to rows ({rows})")
    if mode == "token_mean":
        return None, None
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
