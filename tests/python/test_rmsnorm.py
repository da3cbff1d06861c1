"""RMSNorm against the NumPy fp64 reference: the CPU backend always, the CUDA kernels on a GPU.

Every run draws fresh random inputs, poisons its outputs with NaN first (an unwritten element
fails the comparison), and covers the casting modes, dtypes, weight dtypes, residual fusion,
optional rstd, padded row strides, unaligned pointers and the kernel size classes.
"""
import numpy as np
import pytest

import headloss
from ref_rmsnorm import DTYPES, TOL, rel_err, rmsnorm_bwd_ref, rmsnorm_ref

CASTS = ["llama", "gemma", "none"]
XDTS = ["float32", "float16", "bfloat16"]
EPS = 1e-5


class Host:
    """The CPU backend's side of the tests: NumPy arrays in and out."""

    def put(self, a):
        return np.ascontiguousarray(a)

    def empty_like_poisoned(self, shape, dtype):
        return np.full(shape, np.nan, dtype=DTYPES[dtype])

    def get(self, a):
        return np.asarray(a, np.float64)


def draw(rng, rows, cols, xdt, residual, cast, wdt=None, ydt=None):
    """Inputs; the weight's and y's dtypes drawn at random unless given."""
    x = (rng.standard_normal((rows, cols)) * rng.uniform(0.3, 4.0)).astype(DTYPES[xdt])
    wdt = wdt or str(rng.choice(XDTS + ["none"]))
    w = None if wdt == "none" else (1 + 0.5 * rng.standard_normal(cols)).astype(DTYPES[wdt])
    r = rng.standard_normal((rows, cols)).astype(DTYPES[xdt]) if residual else None
    offset = 1.0 if cast == "gemma" else 0.0  # without a weight it is ignored (y = x_hat)
    ydt = ydt or str(rng.choice(XDTS))
    return x, w, r, offset, ydt


def place(dev, a, layout, rng):
    """a on the device as a [rows, cols] view: packed, with padded rows, or off by one element."""
    rows, cols = a.shape
    if layout == "padded":
        full = np.zeros((rows, cols + int(rng.integers(1, 9))), a.dtype)
        full[:, :cols] = a
        return dev.put(full)[:, :cols]
    if layout == "unaligned":
        flat = np.zeros(rows * cols + 1, a.dtype)
        flat[1:] = a.reshape(-1)
        return dev.put(flat)[1:].reshape(rows, cols)
    return dev.put(a)


def check_forward(dev, rng, rows, cols, xdt, cast, residual, layout="packed", want_rstd=True, wdt=None,
                  ydt=None):
    x, w, r, offset, ydt = draw(rng, rows, cols, xdt, residual, cast, wdt, ydt)
    y = dev.empty_like_poisoned((rows, cols), ydt)
    s = dev.empty_like_poisoned((rows, cols), xdt) if residual else None
    rstd = dev.empty_like_poisoned((rows,), "float32") if want_rstd else None
    out = headloss.rmsnorm_fwd(place(dev, x, layout, rng), None if w is None else dev.put(w),
                               eps=EPS, offset=offset, cast=cast,
                               residual=None if r is None else place(dev, r, layout, rng),
                               out=y, residual_out=s, rstd=rstd)
    y_ref, s_ref, rstd_ref = rmsnorm_ref(x, w, r, eps=EPS, offset=offset, cast=cast, xdt=xdt)
    what = f"{rows}x{cols} x={xdt} y={ydt} w={None if w is None else w.dtype} {cast} res={residual} {layout}"
    # Where the mode rounds s * rstd to x's dtype, a tie may round the other way than in fp64.
    tol = TOL[ydt] if cast == "gemma" else max(TOL[ydt], TOL[xdt] / 20)
    assert rel_err(dev.get(out.y), y_ref) <= tol, what
    if residual:
        assert rel_err(dev.get(out.residual_out), s_ref) <= TOL[xdt] / 4, what
    if want_rstd:
        assert rel_err(dev.get(out.rstd), rstd_ref) <= 1e-5, what


def check_backward(dev, rng, rows, cols, xdt, cast, fused, layout="packed", with_rstd=True):
    s, w, _, offset, dydt = draw(rng, rows, cols, xdt, False, cast)
    dy = rng.standard_normal((rows, cols)).astype(DTYPES[dydt])
    dres = rng.standard_normal((rows, cols)).astype(DTYPES[xdt]) if fused else None
    _, _, rstd = rmsnorm_ref(s, eps=EPS, xdt=xdt)
    dx = dev.empty_like_poisoned((rows, cols), xdt)
    dw = None if w is None else dev.empty_like_poisoned((cols,), "float32")
    g = headloss.rmsnorm_bwd(place(dev, dy, layout, rng), place(dev, s, layout, rng),
                             None if w is None else dev.put(w),
                             dev.put(rstd.astype(np.float32)) if with_rstd else None,
                             eps=EPS, offset=offset, cast=cast,
                             dresidual_out=None if dres is None else dev.put(dres), dx=dx, dw=dw)
    dx_ref, dw_ref = rmsnorm_bwd_ref(dy, s, w, eps=EPS, offset=offset, cast=cast, xdt=xdt, dres=dres)
    what = f"{rows}x{cols} x={xdt} dy={dydt} {cast} fused={fused} {layout} rstd={with_rstd}"
    assert rel_err(dev.get(g.dx), dx_ref) <= TOL[xdt], what
    if w is not None:
        assert rel_err(dev.get(g.dw), dw_ref) <= (1e-5 if xdt == "float32" else 2e-3), what


CPU_SHAPES = [(1, 1), (3, 7), (5, 128), (2, 1000), (3, 4099)]


@pytest.mark.parametrize("cast", CASTS)
@pytest.mark.parametrize("xdt", XDTS)
@pytest.mark.parametrize("residual", [False, True])
def test_cpu_forward(rng, cast, xdt, residual):
    for i, (rows, cols) in enumerate(CPU_SHAPES):
        check_forward(Host(), rng, rows, cols, xdt, cast, residual, ["packed", "padded"][i % 2],
                      want_rstd=bool(i % 3))


@pytest.mark.parametrize("cast", CASTS)
@pytest.mark.parametrize("xdt", XDTS)
@pytest.mark.parametrize("fused", [False, True])
def test_cpu_backward(rng, cast, xdt, fused):
    # cols = 1 is left out: there dx = rstd * g * eps / (s^2 + eps) is pure cancellation.
    for i, (rows, cols) in enumerate(CPU_SHAPES[1:]):
        check_backward(Host(), rng, rows, cols, xdt, cast, fused, ["packed", "padded"][i % 2],
                       with_rstd=bool(i % 2))


def test_cpu_backward_matches_finite_differences(rng):
    """The backward is the derivative of the forward (fp32, gemma: no intermediate rounding)."""
    rows, cols, h = 3, 6, 1e-3
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(cols)).astype(np.float32)
    dy = rng.standard_normal((rows, cols)).astype(np.float32)

    def loss(xv, wv):
        y = headloss.rmsnorm_fwd(xv.astype(np.float32), wv.astype(np.float32), eps=EPS, cast="gemma").y
        return float(np.sum(y.astype(np.float64) * dy))

    g = headloss.rmsnorm_bwd(dy, x, w, eps=EPS, cast="gemma")
    num_dx = np.zeros((rows, cols))
    for i in range(rows):
        for j in range(cols):
            e = np.zeros((rows, cols), np.float32)
            e[i, j] = h
            num_dx[i, j] = (loss(x + e, w) - loss(x - e, w)) / (2 * h)
    num_dw = np.array([(loss(x, w + h * (np.arange(cols) == j)) - loss(x, w - h * (np.arange(cols) == j))) / (2 * h)
                       for j in range(cols)])
    assert rel_err(g.dx, num_dx) < 2e-3
    assert rel_err(g.dw, num_dw) < 2e-3


def test_leading_dims_and_numpy_outputs(rng):
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    y = headloss.rmsnorm(x, np.ones(16, np.float32), eps=EPS)
    y_ref, _, _ = rmsnorm_ref(x.reshape(6, 16), np.ones(16), eps=EPS, xdt="float32")
    assert y.shape == x.shape and rel_err(y.reshape(6, 16), y_ref) < TOL["float32"]


def test_offset_without_weight_is_ignored(rng):
    """As HF's and Liger's norms (Gemma's norm without a scale): y = x_hat, the offset unused."""
    x = rng.standard_normal((3, 40)).astype(np.float32)
    for cast in CASTS:
        y = headloss.rmsnorm_fwd(x, offset=1.0, eps=EPS, cast=cast).y
        assert rel_err(y, rmsnorm_ref(x, eps=EPS, cast=cast)[0]) < TOL["float32"], cast
        dy = rng.standard_normal(x.shape).astype(np.float32)
        dx = headloss.rmsnorm_bwd(dy, x, offset=1.0, eps=EPS, cast=cast).dx
        assert rel_err(dx, rmsnorm_bwd_ref(dy, x, eps=EPS, cast=cast)[0]) < 1e-5, cast


def test_errors_raise_with_the_library_message():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(headloss.HeadlossError, match="eps is -1"):
        headloss.rmsnorm_fwd(x, eps=-1.0)
    with pytest.raises(headloss.HeadlossValueError, match="cast is 'mistral'; expected one of"):
        headloss.rmsnorm(x, cast="mistral")


# --- CUDA kernels -------------------------------------------------------------------------------
# Column counts cover every register shape (8..16384 packs; from 1025 packs in the backward and
# 4097 in the forward a row spreads over a cluster of blocks, 12296 and 16392 leaving the last
# ranks part of their columns or none; 24584 fills a 32K forward row's threads in part), the
# block-per-row kernels (odd sizes, past what clusters hold, up to 256K) and rows shorter than a
# pack.
GPU_COLS = [3, 64, 128, 256, 512, 1000, 1024, 2048, 4096, 8192, 12296, 16384, 16392, 24584, 32768,
            40000, 65536, 131072, 262144]


@pytest.mark.parametrize("cols", GPU_COLS)
@pytest.mark.parametrize("xdt", XDTS)
def test_gpu_forward(gpu, rng, cols, xdt):
    rows = max(1, min(300, (1 << 22) // cols)) + int(rng.integers(0, 7))
    for k, cast in enumerate(CASTS):
        check_forward(gpu, rng, rows, cols, xdt, cast, residual=bool(k % 2),
                      layout=["packed", "padded", "unaligned"][(k + cols) % 3], want_rstd=k != 1)


@pytest.mark.parametrize("cols", GPU_COLS)
@pytest.mark.parametrize("xdt", XDTS)
def test_gpu_backward(gpu, rng, cols, xdt):
    rows = max(1, min(300, (1 << 22) // cols)) + int(rng.integers(0, 7))
    for k, cast in enumerate(CASTS):
        check_backward(gpu, rng, rows, cols, xdt, cast, fused=bool(k % 2),
                       layout=["packed", "padded", "unaligned"][(k + cols) % 3], with_rstd=k != 2)


@pytest.mark.parametrize("cols", [1000, 1024, 2048, 4096, 8192, 12296, 16384])
@pytest.mark.parametrize("xdt", ["float16", "bfloat16"])
def test_gpu_forward_weight_of_x_dtype(gpu, rng, cols, xdt):
    """x, y and the weight of one 16-bit dtype, no residual: rows of 1024, 2048, 8K and 16K columns
    load the weight with x (1000 and 12296 leave part of a block's threads idle); 4096 reads it at
    the store."""
    rows = 300 + int(rng.integers(0, 7))
    for cast in CASTS:
        check_forward(gpu, rng, rows, cols, xdt, cast, residual=False, wdt=xdt, ydt=xdt)


def test_gpu_many_rows(gpu, rng):
    """More rows than a grid dimension holds (65535), for short and long rows."""
    for rows, cols in [(70001, 128), (66000, 1000)]:
        check_forward(gpu, rng, rows, cols, "bfloat16", "llama", residual=False)
        check_backward(gpu, rng, rows, cols, "bfloat16", "llama", fused=False)


@pytest.mark.parametrize("xdt", XDTS)
def test_gpu_persistent_loops(gpu, rng, xdt):
    """Enough rows that every register shape's persistent blocks loop several times (the staged
    loads of the next rows), ending on a partial row group, and that the forward takes its
    many-row shapes (4096 columns from 2048 rows)."""
    for i, cols in enumerate([64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]):
        rows = (max((1 << 22) // cols, 2048) if cols <= 16384 else 600) + int(rng.integers(1, 32))
        check_forward(gpu, rng, rows, cols, xdt, "llama", residual=i % 2 == 1)
        check_backward(gpu, rng, rows, cols, xdt, "llama", fused=i % 2 == 0, with_rstd=i % 3 != 0)


# one block a row; the same, dw summed in the row kernel after a grid-wide barrier; clusters of 2
# (one block an SM) and of 4
@pytest.mark.parametrize("cols", [4096, 8192, 16384, 40000])
def test_gpu_in_place_and_deterministic(gpu, rng, cols):
    x = rng.standard_normal((513, cols)).astype(DTYPES["bfloat16"])
    w = rng.standard_normal(cols).astype(np.float32)
    ref = gpu.get(headloss.rmsnorm(gpu.put(x), gpu.put(w), eps=EPS))
    buf = gpu.put(x)
    headloss.rmsnorm_fwd(buf, gpu.put(w), eps=EPS, out=buf)
    assert np.array_equal(gpu.get(buf), ref)
    dy = gpu.put(rng.standard_normal((513, cols)).astype(DTYPES["bfloat16"]))
    runs = [headloss.rmsnorm_bwd(dy, gpu.put(x), gpu.put(w), eps=EPS) for _ in range(3)]
    for r in runs[1:]:
        assert np.array_equal(gpu.get(r.dw), gpu.get(runs[0].dw))
        assert np.array_equal(gpu.get(r.dx), gpu.get(runs[0].dx))


def test_gpu_rejects_host_pointers(gpu):
    x = gpu.put(np.ones((2, 8), np.float32))
    with pytest.raises(headloss.HeadlossTypeError, match="weight is in host memory but x is in cuda"):
        headloss.rmsnorm_fwd(x, np.ones(8, np.float32))
