"""The vocabulary-sharded LM-head loss under jax.shard_map, checked against the unsharded one.

Each device holds [N, V / R] columns of the logits; headloss.jax.sharded_fused_loss computes its
block of per-row statistics, all-gathers the blocks along the mesh axis (one jax.lax.all_gather of
a few dozen bytes per row) and finishes: the same loss and metrics on every device, and each
device's slice of the gradient. The result is compared with headloss.jax.fused_loss on the whole
logits (exit status 1 on a mismatch).

The fused linear form the same way: each device holds [V / R, H] rows of the head's weight and the
whole hidden states; headloss.jax.sharded_linear_loss never forms the logits, and its gradient
w.r.t. the hidden states is summed over the devices with one jax.lax.psum. Compared with
headloss.jax.linear_loss on the whole weight.

Runs on all GPUs when there are several, else on 4 CPU devices (the CPU reference backend). After
`make`: python examples/jax_shard_map.py
"""
import os
import sys
from pathlib import Path

# Four host devices to shard over on a machine without GPUs: XLA reads the flag when jax starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=4").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))  # the checkout's package

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import headloss.jax as hlj  # noqa: E402

OPTIONS = dict(terms=("ce", "z"), z_weight=1e-4, label_smoothing=0.1)


def mesh_devices():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    return gpus if len(gpus) > 1 else jax.devices("cpu")[:4]


def rel(a, b) -> float:
    """Relative difference (of the norms), absolute below 1e-3 (metrics that are 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-3))


def show(x) -> str:
    return f"norm {float(jnp.linalg.norm(x)):.7g}" if np.ndim(x) else f"{float(x):.7g}"


def report(rows) -> bool:
    """Prints (name, sharded, unsharded, tolerance) rows; True if every one is within tolerance."""
    print(f"{'':12} {'sharded':>16} {'unsharded':>16} {'rel. diff':>10}")
    ok = True
    for name, got, want, tol in rows:
        if np.ndim(want) == 0 and float(want) == 0 and float(got) == 0:
            continue  # a metric of inputs not passed (GRPO, distillation)
        d = rel(got, want)
        ok &= d <= tol
        verdict = "" if d <= tol else f"  > {tol:g}: MISMATCH"
        print(f"{name:12} {show(got):>16} {show(want):>16} {d:10.2e}{verdict}")
    return ok


def metric_rows(loss, metrics, ref_loss, ref_metrics):
    return [("loss", loss, ref_loss, 1e-5)] + [(k, metrics[k], ref_metrics[k], 1e-5) for k in metrics if k != "loss"]


def linear(mesh, devices, labels) -> bool:
    """The fused linear form: the weight sharded by vocabulary rows (labels: the logits form's, of
    the same vocabulary)."""
    ranks = len(devices)
    N, H, V = labels.shape[0], 128, 1000 * ranks
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((N, H)).astype(np.float32)
    weight = (rng.standard_normal((V, H)) * 3 / np.sqrt(H)).astype(np.float32)
    x = jax.device_put(hidden, NamedSharding(mesh, P()))
    w = jax.device_put(weight, NamedSharding(mesh, P("tp", None)))  # vocabulary-sharded rows
    y = jax.device_put(labels, NamedSharding(mesh, P()))

    def per_device(x, w_shard, y):
        (loss, metrics), grads = jax.value_and_grad(
            lambda x, w: hlj.sharded_linear_loss(x, w, y, axis_name="tp", vocab_global=V, **OPTIONS),
            argnums=(0, 1), has_aux=True)(x, w_shard)
        return loss, metrics, grads  # grads: (hidden's, summed over the devices; this shard's)

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("tp", None), P()),
                                 out_specs=(P(), P(), (P(), P("tp", None)))))
    loss, metrics, (gx, gw) = step(x, w, y)
    whole = jax.jit(jax.value_and_grad(lambda x, w, y: hlj.linear_loss(x, w, y, **OPTIONS),
                                       argnums=(0, 1), has_aux=True))
    (ref_loss, ref_metrics), (rx, rw) = whole(*(jax.device_put(a, devices[0]) for a in (hidden, weight, labels)))
    print(f"\nfused linear form: hidden [{N}, {H}], weight [{V}, {H}] sharded over the vocabulary")
    return report(metric_rows(loss, metrics, ref_loss, ref_metrics) +
                  [("grad hidden", gx, rx, 1e-4), ("grad weight", gw, rw, 1e-4)])


def main() -> int:
    devices = mesh_devices()
    ranks = len(devices)
    N, V = 64, 1000 * ranks
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((N, V)).astype(np.float32) * 3
    labels = rng.integers(0, V, N).astype(np.int32)
    labels[1::3] = np.argmax(logits[1::3], axis=1)  # some right, for the accuracy
    labels[::7] = -100  # ignored rows

    mesh = Mesh(np.array(devices), ("tp",))
    z = jax.device_put(logits, NamedSharding(mesh, P(None, "tp")))  # vocabulary-sharded
    y = jax.device_put(labels, NamedSharding(mesh, P()))

    def per_device(z_shard, y):
        # Differentiate inside the body: each device gets the gradient of its own columns.
        (loss, metrics), grad = jax.value_and_grad(
            lambda z: hlj.sharded_fused_loss(z, y, axis_name="tp", vocab_global=V, **OPTIONS),
            has_aux=True)(z_shard)
        return loss, metrics, grad

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(None, "tp"), P()),
                                 out_specs=(P(), P(), P(None, "tp"))))
    loss, metrics, grad = step(z, y)

    whole = jax.jit(jax.value_and_grad(lambda z, y: hlj.fused_loss(z, y, **OPTIONS), has_aux=True))
    (ref_loss, ref_metrics), ref_grad = whole(jax.device_put(logits, devices[0]),
                                              jax.device_put(labels, devices[0]))

    print(f"{ranks} x {devices[0].platform} devices, logits [{N}, {V}] sharded over the vocabulary")
    ok = report(metric_rows(loss, metrics, ref_loss, ref_metrics) + [("gradient", grad, ref_grad, 1e-4)])
    ok &= linear(mesh, devices, labels)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
