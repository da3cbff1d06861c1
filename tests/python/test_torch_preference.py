"""headloss.torch_preference.preference_loss: the plan's preference term through autograd, both forms,
against the fp64 reference (ref_preference.py) and the plan's own gradient (which test_preference.py
checks against central differences); CPU, and CUDA where there is a GPU."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from headloss.torch_preference import preference_loss  # noqa: E402
from ref_preference import preference  # noqa: E402
from test_preference import V, batch  # noqa: E402

H = 6


def devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("loss,loss_type,ref_free", [("dpo", "sigmoid", False), ("dpo", "ipo", False),
                                                     ("simpo", "sigmoid", True), ("orpo", "sigmoid", True)])
def test_linear_form_loss_metrics_and_gradients(device, loss, loss_type, ref_free):
    rng = np.random.default_rng(11)
    _, labels, cu = batch(rng, loss, 4)
    x64 = rng.normal(size=(len(labels), H))
    w64 = rng.normal(size=(V, H)) / 2
    ref = None if ref_free else rng.normal(size=len(cu) - 1) - 3
    t = lambda a, dt=torch.float32: torch.tensor(a, dtype=dt, device=device)  # noqa: E731
    hidden, weight = t(x64).requires_grad_(), t(w64).requires_grad_()
    opts = dict(loss=loss, loss_type=loss_type, beta=0.7)
    if loss == "simpo":
        opts["gamma"] = 0.4
    value, metrics = preference_loss(hidden, weight, t(labels, torch.int64), t(cu, torch.int32),
                                     None if ref is None else t(ref), **opts)
    (2.0 * value).backward()
    z = hidden.detach().double().cpu().numpy() @ weight.detach().double().cpu().numpy().T
    rkw = dict(beta=0.7, mean=loss in ("simpo", "orpo") or loss_type == "ipo", ref=ref)
    if loss == "simpo":
        rkw["gamma"] = 0.4
    want, ref_metrics = preference(loss, loss_type, z, labels, cu, **rkw)
    np.testing.assert_allclose(value.item(), want, rtol=1e-4, atol=1e-6)
    trl = {"rewards/chosen": "rewards_chosen", "logps/chosen": "logps_chosen", "logps/rejected": "logps_rejected"}
    for name, key in trl.items():
        if key in ref_metrics:
            np.testing.assert_allclose(metrics[name].item(), ref_metrics[key], rtol=1e-4, atol=1e-5, err_msg=name)
    # the same through the logits form: its gradient, pushed through the products, is ours
    logits = torch.tensor(z, dtype=torch.float32, device=device, requires_grad=True)
    lv, _ = preference_loss(logits, None, t(labels, torch.int64), t(cu, torch.int32),
                            None if ref is None else t(ref), **opts)
    (2.0 * lv).backward()
    g = logits.grad.double().cpu().numpy()
    np.testing.assert_allclose(lv.item(), value.item(), rtol=1e-5)
    np.testing.assert_allclose(hidden.grad.double().cpu().numpy(), g @ w64, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(weight.grad.double().cpu().numpy(), g.T @ x64, rtol=1e-3, atol=1e-5)


def test_nll_on_the_chosen_completions():
    rng = np.random.default_rng(4)
    logits, labels, cu = batch(rng, "orpo", 4)
    x = torch.tensor(logits, dtype=torch.float32, requires_grad=True)
    value, metrics = preference_loss(x, None, torch.tensor(labels), torch.tensor(cu, dtype=torch.int32),
                                     loss="orpo", beta=0.5, nll_weight=1.0)
    P = (len(cu) - 1) // 2
    chosen = (labels >= 0) & (np.arange(len(labels)) < cu[P])
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    nll = -lp[np.arange(len(labels)), np.maximum(labels, 0)][chosen].mean()
    np.testing.assert_allclose(metrics["nll_loss"].item(), nll, rtol=1e-5)
    want, _ = preference("orpo", "sigmoid", logits, labels, cu, beta=0.5, mean=True)
    np.testing.assert_allclose(value.item(), nll + want, rtol=1e-5)
