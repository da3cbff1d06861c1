"""One error type (HeadlossError, a ValueError or a TypeError as fits, naming the argument) and one
defaults rule (None: the library's default; an explicit 0 that the library would read as a
nonzero default is refused), the same for the C descriptor, LossPlan, the torch ops and JAX."""
import ctypes
import math

import numpy as np
import pytest

import headloss
from headloss import _abi
from headloss._loss_options import OPTION_DEFAULTS, PLAN_OPTIONS, _INSTEAD_OF_ZERO
from headloss.loss import _create, _execute, _check

VOCAB = 1000
CE, Z = math.log(VOCAB), math.log(VOCAB) ** 2  # uniform logits: lse = log V


def uniform(rows=4):
    return np.zeros((rows, VOCAB), np.float32), np.arange(rows, dtype=np.int64)


def test_error_classes():
    assert issubclass(headloss.HeadlossValueError, headloss.HeadlossError)
    assert issubclass(headloss.HeadlossValueError, ValueError)
    assert issubclass(headloss.HeadlossTypeError, headloss.HeadlossError)
    assert issubclass(headloss.HeadlossTypeError, TypeError)
    assert issubclass(headloss.HeadlossError, RuntimeError)
    with pytest.raises(ValueError) as e:  # the library's INVALID_VALUE
        headloss.rmsnorm(np.ones((2, 4), np.float32), eps=-1.0)
    assert isinstance(e.value, headloss.HeadlossValueError) and e.value.status == _abi.HL_STATUS_INVALID_VALUE


def test_terms_by_name():
    z, y = uniform()
    one = headloss.fused_loss(z, y, terms="ce").as_dict()["loss"]
    assert one == headloss.fused_loss(z, y, terms=("ce",)).as_dict()["loss"] == pytest.approx(CE, rel=1e-6)
    for bad in (("cross_entropy",), "cross_entropy", ["ce", "zz"]):
        with pytest.raises(headloss.HeadlossValueError, match="unknown term .*; the terms are ce, z, entropy"):
            headloss.LossPlan(VOCAB, "float32", terms=bad)
    with pytest.raises(headloss.HeadlossTypeError, match="terms is 1.5"):
        headloss.LossPlan(VOCAB, "float32", terms=1.5)
    assert set(headloss.TERMS) >= {"ce", "z", "entropy", "kl_ref"} and headloss.SCALARS[0] == "loss"


def test_float64_logits_named():
    z, y = uniform()
    with pytest.raises(headloss.HeadlossTypeError, match="^logits is float64; expected float32, float16 or bfloat16$"):
        headloss.fused_loss(z.astype(np.float64), y)
    with pytest.raises(TypeError, match="^logits is float64; expected float32$"):
        headloss.LossPlan(VOCAB, "float32")(z.astype(np.float64), y)


def test_unknown_keywords():
    z, y = uniform()
    with pytest.raises(headloss.HeadlossTypeError, match="unknown loss plan option 'zweight'"):
        headloss.fused_loss(z, y, zweight=1e-4)
    with pytest.raises(headloss.HeadlossTypeError, match="unexpected arguments: grads"):
        headloss.LossPlan(VOCAB, "float32").finish(None, z, y, grads=None)


def _raw_loss(**fields) -> float:
    """The loss of a descriptor set up as a C caller would (zeroed, struct_size, `fields`)."""
    z, y = uniform()
    d = _abi.hl_loss_plan_desc_t(struct_size=ctypes.sizeof(_abi.hl_loss_plan_desc_t), backend=_abi.HL_BACKEND_CPU,
                                 vocab=VOCAB, logits_dtype=_abi.HL_DTYPE_F32, labels_dtype=_abi.HL_DTYPE_I64,
                                 terms=_abi.HL_LOSS_CE | _abi.HL_LOSS_Z, **fields)
    plan = ctypes.c_void_p()
    _check(_create(ctypes.byref(d), ctypes.byref(plan)))
    scalars = np.zeros(_abi.HL_LOSS_NUM_SCALARS, np.float32)
    a = _abi.hl_loss_args_t(struct_size=ctypes.sizeof(_abi.hl_loss_args_t), rows=len(y), logits=z.ctypes.data,
                            labels=y.ctypes.data, scalars=scalars.ctypes.data)
    try:
        _check(_execute(plan, ctypes.byref(a), None, 0, None))
    finally:
        headloss.loss._destroy(plan)
    return float(scalars[0])


def test_z_loss_default_is_1e_4_everywhere():
    """The README's line: fused_loss(z, labels, terms=("ce", "z")) on uniform logits is CE + 1e-4 z,
    as C with z_weight 0 or the INIT macro's value, the torch op and JAX say."""
    want = CE + 1e-4 * Z
    z, y = uniform()
    got = {"python": headloss.fused_loss(z, y, terms=("ce", "z")).as_dict()["loss"],
           "plan": headloss.LossPlan(VOCAB, "float32", terms=("ce", "z"))(z, y).as_dict()["loss"],
           "c zero": _raw_loss(),
           "c INIT": _raw_loss(z_weight=_abi.hl_loss_plan_desc_t._defaults_["z_weight"])}
    try:
        import torch
        from headloss.torch_ops import lm_head_loss
        got["torch"] = float(lm_head_loss(torch.from_numpy(z), torch.from_numpy(y), terms=("ce", "z"))[0])
    except ImportError:
        pass
    try:
        import jax.numpy as jnp
        import headloss.jax as hlj
        got["jax"] = float(hlj.fused_loss(jnp.asarray(z), jnp.asarray(y, jnp.int32), terms=("ce", "z"))[0])
    except ImportError:
        pass
    for k, v in got.items():
        assert v == pytest.approx(want, rel=1e-6), (k, got)


@pytest.mark.parametrize("name", sorted(_INSTEAD_OF_ZERO))
def test_explicit_zero_is_refused(name):
    with pytest.raises(headloss.HeadlossValueError, match=f"^{name}=0 is refused: the library reads 0 as its "
                       "default .*which None gives; "):
        headloss.LossPlan(VOCAB, "float32", terms=("ce",), **{name: 0})


def test_explicit_zero_refused_in_calls_and_frontends():
    z, y = uniform()
    plan = headloss.LossPlan(VOCAB, "float32")
    for k in ("divisor", "grad_scale"):
        with pytest.raises(headloss.HeadlossValueError, match=f"{k}=0 is refused"):
            plan(z, y, **{k: 0.0})
    try:
        import jax.numpy as jnp
        import headloss.jax as hlj
    except ImportError:
        return
    with pytest.raises(headloss.HeadlossValueError, match="z_weight=0 is refused"):
        hlj.fused_loss(jnp.asarray(z), jnp.asarray(y, jnp.int32), terms=("ce", "z"), z_weight=0.0)


def test_zero_where_zero_is_a_value():
    z, y = uniform()
    for k in ("label_smoothing", "softcap", "dual_clip", "vocab_start"):
        assert OPTION_DEFAULTS[k].startswith("0")
        headloss.LossPlan(VOCAB, "float32", **{k: 0})


@pytest.mark.parametrize("term, weight", [("entropy", "entropy_weight"), ("kl_ref", "kl_ref_beta")])
def test_terms_without_a_conventional_weight(term, weight):
    msg = f"{weight} is 0, and its term has no conventional weight: set it"
    with pytest.raises(headloss.HeadlossValueError, match=msg):
        headloss.LossPlan(VOCAB, "float32", terms=("ce", term))
    try:
        import jax.numpy as jnp
        import headloss.jax as hlj
    except ImportError:
        return
    z, y = uniform()
    with pytest.raises(headloss.HeadlossValueError, match=msg):  # raised at trace time, as LossPlan
        hlj.fused_loss(jnp.asarray(z), jnp.asarray(y, jnp.int32), terms=("ce", term))


def test_defaults_are_documented():
    doc = headloss.LossPlan.__doc__
    for k in PLAN_OPTIONS:
        assert f"{k}: default {OPTION_DEFAULTS[k]}" in doc, k
    assert "z_weight: default 0.0001" in doc and "jsd_beta: default 0.5" in doc
    assert "eps_low: default 0.2" in doc and "rollout_cap: default 2.0" in doc
