"""headloss.fla_backend without fla, torch or a GPU: which chunk_bwd_dqkwg calls go to headloss
(takes, on stand-in tensors) and which to fla's own kernel, through a stand-in of fla 0.6's backend
registry. On a GPU, fla's own GDN tests run with the drop-in enabled (bench/notes/gdn.md, "GDN v8")."""
from __future__ import annotations

import sys
import types

import pytest

import headloss.fla_backend as fb


class FakeTensor:
    def __init__(self, shape, dtype="bfloat16", device="cuda:0", contiguous=True):
        self.shape, self.dtype, self.contiguous = tuple(shape), f"torch.{dtype}", contiguous
        self.device, self.is_cuda = device, device.startswith("cuda")

    def is_contiguous(self):
        return self.contiguous


def call(B=2, T=200, H=2, HV=4, K=128, V=128, dtype="bfloat16", h_dtype=None, vf=False, gate="g", dw=True,
         varlen=False, **over):
    """fla's keyword arguments for one chunk_bwd_dqkwg call, as chunk_gated_delta_rule makes them."""
    t = lambda *shape, dt=dtype: FakeTensor(shape, dt)
    NT = (T + 63) // 64
    state = (B, NT, HV, V, K) if vf else (B, NT, HV, K, V)
    kw = dict(q=t(B, T, H, K), k=t(B, T, H, K), v=t(B, T, HV, V), do=t(B, T, HV, V),
              h=t(*state, dt=h_dtype or dtype), dh=t(*state, dt=h_dtype or dtype),
              w=t(B, T, HV, K) if dw else None, dv=t(B, T, HV, V) if dw else None,
              g=t(B, T, HV, dt="float32") if gate == "g" else None,
              g_gamma=t(HV, dt="float32") if gate == "gamma" else None,
              scale=K ** -0.5, state_v_first=vf, chunk_size=64,
              cu_seqlens=FakeTensor((5,), "int64") if varlen else None)
    kw.update(over)
    return kw


TAKEN = {
    "gdn bf16": call(),
    "fp16, no dw": call(dtype="float16", dw=False),
    "GVA 8, K = 256": call(H=1, HV=8, K=256, V=256),
    "state_v_first": call(vf=True),
    "fp32 states": call(h_dtype="float32"),
    "g_gamma": call(gate="gamma"),
    "no gate (delta rule)": call(gate=None),
    "varlen": call(B=1, varlen=True),
    "odd K, V": call(K=60, V=100),
}

REFUSED = {  # call, a word of the reason
    "fp32 inputs": (call(dtype="float32"), "q is torch.float32"),
    "on the CPU": (call(q=FakeTensor((2, 200, 2, 128), device="cpu")), "not a CUDA tensor"),
    "two devices": (call(k=FakeTensor((2, 200, 2, 128), device="cuda:1")), "more than one device"),
    "not contiguous": (call(h=FakeTensor((2, 4, 4, 128, 128), contiguous=False)), "h is not contiguous"),
    "chunk 128": (call(chunk_size=128), "chunk_size"),
    "K = 512": (call(K=512), "K = 512"),
    "HV not a multiple": (call(H=3, HV=4), "multiple"),
    "w without dv": (call(dv=None), "w without dv"),
    "dw dtype": (call(w=FakeTensor((2, 200, 4, 128), "float16")), "w is torch.float16"),
    "fp16 states with bf16": (call(h_dtype="float16"), "h is torch.float16"),
    "v-first shape, default flag": (call(K=64, V=128, h=FakeTensor((2, 4, 4, 128, 64)),
                                         dh=FakeTensor((2, 4, 4, 128, 64))), "expected [B, NT, 4, 64, 128]"),
    "bf16 gate": (call(g=FakeTensor((2, 200, 4), "bfloat16")), "float32 gates"),
    "varlen with B = 2": (call(varlen=True), "B = 1"),
    "both gates": (call(g_gamma=FakeTensor((4,), "float32")), "both g and g_gamma"),
    "an argument fla may add": (call(new_option=True), "does not know"),
}


@pytest.mark.parametrize("name", TAKEN)
def test_takes(name):
    assert fb.takes(**TAKEN[name]) == (True, None)


@pytest.mark.parametrize("name", REFUSED)
def test_refuses(name):
    kw, why = REFUSED[name]
    ok, reason = fb.takes(**kw)
    assert not ok and why in reason, reason


def test_takes_positional_arguments():
    kw = call()
    args = [kw.pop(n) for n in ("q", "k", "v", "do", "h", "dh", "w", "g")]
    assert fb.takes(*args, **kw) == (True, None)


# ------------------------------------------------------------ fla 0.6's backend registry, stood in

class StubBackend:
    """fla.backends.BaseBackend as fla 0.6 uses it: availability, enablement, a verifier named
    <function>_verifier, an implementation named <function>."""
    priority = 5

    @classmethod
    def is_available(cls):
        return True

    def is_enabled(self):
        return True

    def verify(self, function_name, *args, **kwargs):
        try:
            return getattr(self, f"{function_name}_verifier")(*args, **kwargs)
        except Exception as e:  # noqa: BLE001  (fla: a verifier that raises refuses)
            return False, str(e)


@pytest.fixture
def fake_fla(monkeypatch):
    """fla.backends with register('common') collecting backends, and a dispatch as fla's:
    backends by priority, the first enabled one whose verifier accepts runs, else fla's own."""
    registry = []

    def register(op):
        assert op == "common"
        def deco(cls):
            registry.append(cls())
            return cls
        return deco

    def dispatch(default):
        def wrapper(*args, **kwargs):
            for b in sorted(registry, key=lambda b: b.priority):
                if b.is_available() and b.is_enabled() and b.verify(default.__name__, *args, **kwargs)[0]:
                    return getattr(b, default.__name__)(*args, **kwargs)
            return default(*args, **kwargs)
        return wrapper

    mod = types.ModuleType("fla.backends")
    mod.BaseBackend, mod.register = StubBackend, register
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.backends", mod)
    monkeypatch.setattr(fb, "_registered", False)
    monkeypatch.setattr(fb, "_enabled", False)
    monkeypatch.setattr(fb, "cuda_available", lambda: True)
    calls = []
    monkeypatch.setattr(fb, "gdn_bwd_dqkwg", lambda *a, **kw: calls.append(kw) or
                        types.SimpleNamespace(dq="dq", dk="dk", dw="dw", dg="dg"))

    @dispatch
    def chunk_bwd_dqkwg(*args, **kwargs):  # fla's own kernel
        return "fla"

    return chunk_bwd_dqkwg, registry, calls


def test_routing_through_fla_registry(fake_fla):
    fla_op, registry, calls = fake_fla
    assert fla_op(**call()) == "fla"  # not enabled: nothing registered
    fb.enable()
    fb.enable()  # idempotent: one registration
    assert len(registry) == 1 and registry[0].backend_type == "headloss"
    assert fla_op(**call()) == ("dq", "dk", "dw", "dg")
    kw = calls[-1]
    assert kw["gate_log2"] and not kw["check"] and kw["dv"] is not None and not kw["state_v_first"]
    fla_op(**call(vf=True, dw=False, gate="gamma"))
    kw = calls[-1]
    assert kw["state_v_first"] and kw["dv"] is None and kw["g_gamma"] is not None and kw["g"] is None
    for name, (kwargs, _) in REFUSED.items():
        assert fla_op(**kwargs) == "fla", name
    n = len(calls)
    fb.disable()
    assert not fb.enabled() and fla_op(**call()) == "fla" and len(calls) == n
    fb.enable()
    assert fla_op(**call()) == ("dq", "dk", "dw", "dg")


def test_enable_without_cuda(monkeypatch):
    monkeypatch.setattr(fb, "cuda_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA backend"):
        fb.enable()
